#include "moeplan/executor/io/data_prepare.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

namespace {

std::vector<std::string> read_documents(const std::string& path, const std::string& separator) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError("--input", {{"", "cannot read " + path}});
  std::vector<std::string> docs;
  std::string line, doc;
  auto flush = [&] {
    if (doc.find_first_not_of(" \t\r\n") != std::string::npos) docs.push_back(doc);
    doc.clear();
  };
  while (std::getline(in, line)) {
    if (!separator.empty() && line == separator) {
      flush();
      continue;
    }
    if (!doc.empty()) doc += '\n';
    doc += line;
  }
  flush();
  return docs;
}

class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& docs) : docs_(docs) { advance(); }
  bool done() const override { return doc_ >= docs_.size(); }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  // Every non-empty line of every document, in order.
  void advance() {
    while (doc_ < docs_.size()) {
      const std::string& d = docs_[doc_];
      if (pos_ > d.size()) {
        ++doc_;
        pos_ = 0;
        continue;
      }
      size_t end = d.find('\n', pos_);
      if (end == std::string::npos) end = d.size();
      line_ = d.substr(pos_, end - pos_);
      pos_ = end + 1;
      if (!line_.empty()) return;
    }
  }
  const std::vector<std::string>& docs_;
  size_t doc_ = 0, pos_ = 0;
  std::string line_;
};

// A BPE tokenizer configured like Llama's and Mixtral's: byte fallback, digits split,
// no normalisation, <unk>=0 <s>=1 </s>=2.
std::string train_tokenizer(const std::vector<std::string>& docs, int64_t vocab_size, int threads) {
  std::ostringstream args;
  args << "--model_type=bpe --vocab_size=" << vocab_size
       << " --character_coverage=1.0 --byte_fallback=true --split_digits=true"
       << " --normalization_rule_name=identity --remove_extra_whitespaces=false --add_dummy_prefix=true"
       << " --allow_whitespace_only_pieces=true --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1"
       << " --max_sentence_length=65536 --num_threads=" << threads << " --minloglevel=2";
  LineIterator lines(docs);
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args.str(), &lines, &model);
  if (!status.ok())
    throw InputError("--vocab-size", {{"", "SentencePiece could not train a tokenizer of " + std::to_string(vocab_size) +
                                               " pieces on this text: " + status.ToString()}});
  return model;
}

}  // namespace

PrepareSummary prepare_data(const PrepareOptions& o, const ProgressFn& progress) {
  auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  Diagnostics d;
  if (o.inputs.empty()) d.error("--input", "give at least one text file");
  if (o.block_size < 2) d.error("--block-size", "must be at least 2, got " + std::to_string(o.block_size));
  if (o.tokenizer.empty() && o.vocab_size < 260)
    d.error("--vocab-size", "a trained tokenizer needs at least 260 pieces (256 bytes and 3 specials), got " +
                                std::to_string(o.vocab_size));
  if (o.out_dir.empty()) d.error("--out", "give an output folder");
  d.throw_if_any("data prepare");

  std::vector<std::string> docs;
  for (const std::string& path : o.inputs) {
    std::vector<std::string> file_docs = read_documents(path, o.document_separator);
    std::move(file_docs.begin(), file_docs.end(), std::back_inserter(docs));
  }
  if (docs.empty()) throw InputError("--input", {{"", "the input files hold no text"}});
  say("read " + std::to_string(docs.size()) + " documents from " + std::to_string(o.inputs.size()) + " files");

  fs::create_directories(o.out_dir);
  const std::string manifest_path = o.out_dir + "/manifest.json";
  fs::remove(manifest_path);  // the folder is not valid until the new manifest is written

  std::string model;
  if (o.tokenizer.empty()) {
    say("training a " + std::to_string(o.vocab_size) + "-piece BPE tokenizer");
    model = train_tokenizer(docs, o.vocab_size, o.threads);
  } else {
    std::ifstream in(o.tokenizer, std::ios::binary);
    if (!in) throw InputError("--tokenizer", {{"", "cannot read " + o.tokenizer}});
    model.assign(std::istreambuf_iterator<char>(in), {});
  }
  sentencepiece::SentencePieceProcessor sp;
  if (const auto status = sp.LoadFromSerializedProto(model); !status.ok())
    throw InputError("--tokenizer", {{"", o.tokenizer + " is not a SentencePiece model: " + status.ToString()}});
  const int64_t vocab = sp.GetPieceSize();
  if (!o.tokenizer.empty() && o.vocab_size > 0 && o.vocab_size != vocab)
    throw InputError("--vocab-size", {{"", std::to_string(o.vocab_size) + " does not match the tokenizer's " +
                                               std::to_string(vocab) + " pieces"}});
  if (sp.bos_id() < 0) throw InputError("--tokenizer", {{"", "the tokenizer has no <s> (bos) piece"}});
  write_file_atomic(o.out_dir + "/tokenizer.model", model);

  const int64_t token_bytes = vocab <= 65536 ? 2 : 4;
  std::vector<int> ids;
  std::vector<uint64_t> index;
  std::string tokens;
  std::vector<int64_t> counts(static_cast<size_t>(vocab), 0);
  int64_t total = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (const auto status = sp.Encode(docs[i], &ids); !status.ok())
      throw InputError("--input", {{"", "tokenizing document " + std::to_string(i) + ": " + status.ToString()}});
    ids.insert(ids.begin(), sp.bos_id());  // like the Llama and Mixtral tokenizers
    index.push_back(static_cast<uint64_t>(total));
    for (const int id : ids) {
      const uint32_t v = static_cast<uint32_t>(id);
      for (int64_t b = 0; b < token_bytes; ++b) tokens.push_back(static_cast<char>((v >> (8 * b)) & 0xFF));
    }
    total += static_cast<int64_t>(ids.size());
    if ((i + 1) % 2000 == 0) say("tokenized " + std::to_string(i + 1) + " of " + std::to_string(docs.size()) + " documents");
  }
  index.push_back(static_cast<uint64_t>(total));
  const int64_t blocks = total / o.block_size;
  if (blocks == 0)
    throw InputError("--block-size", {{"", std::to_string(o.block_size) + " is longer than the whole corpus (" +
                                               std::to_string(total) + " tokens)"}});
  // Unigram entropy of what training reads: the tokens inside blocks.
  const auto* raw = reinterpret_cast<const unsigned char*>(tokens.data());
  for (int64_t i = 0; i < blocks * o.block_size; ++i) {
    uint32_t v = 0;
    for (int64_t b = 0; b < token_bytes; ++b) v |= static_cast<uint32_t>(raw[i * token_bytes + b]) << (8 * b);
    ++counts[v];
  }
  double entropy = 0;
  const double n = static_cast<double>(blocks * o.block_size);
  for (const int64_t c : counts)
    if (c > 0) entropy -= (static_cast<double>(c) / n) * std::log(static_cast<double>(c) / n);

  std::string index_bytes;
  for (const uint64_t v : index)
    for (int b = 0; b < 8; ++b) index_bytes.push_back(static_cast<char>((v >> (8 * b)) & 0xFF));
  write_file_atomic(o.out_dir + "/tokens.bin", tokens);
  write_file_atomic(o.out_dir + "/index.bin", index_bytes);

  Json manifest;
  manifest["schema_version"] = kTokensSchemaVersion;
  manifest["kind"] = "moeplan-tokens";
  manifest["vocab_size"] = vocab;
  manifest["block_size"] = o.block_size;
  manifest["token_bytes"] = token_bytes;
  manifest["tokens"] = total;
  manifest["blocks"] = blocks;
  manifest["documents"] = static_cast<int64_t>(docs.size());
  manifest["unigram_entropy_nats"] = entropy;
  manifest["tokenizer"] = {{"file", "tokenizer.model"},
                           {"trained_here", o.tokenizer.empty()},
                           {"crc32", crc32(model.data(), model.size())}};
  manifest["files"] = {
      {"tokens.bin", {{"bytes", tokens.size()}, {"crc32", crc32(tokens.data(), tokens.size())}}},
      {"index.bin", {{"bytes", index_bytes.size()}, {"crc32", crc32(index_bytes.data(), index_bytes.size())}}}};
  manifest["inputs"] = o.inputs;
  write_file_atomic(manifest_path, manifest.dump(2) + "\n");
  say("wrote " + std::to_string(total) + " tokens, " + std::to_string(blocks) + " blocks of " +
      std::to_string(o.block_size) + " to " + o.out_dir);
  return {static_cast<int64_t>(docs.size()), total, blocks, vocab, entropy};
}

}  // namespace moeplan::executor
