#pragma once
// Training data: text tokenized by SentencePiece, packed into fixed-length blocks like the
// Hugging Face run_clm example's group_texts (concatenate, drop the remainder, cut; the labels are
// the inputs shifted by one inside the model's loss), stored as a memory-mapped token file with
// a document index and a manifest.
//
//   DIR/tokens.bin     little-endian uint16 (vocabularies up to 65,536) or uint32 token ids
//   DIR/index.bin      little-endian uint64 start of every document, then the total
//   DIR/tokenizer.model
//   DIR/manifest.json  written last: sizes, checksums, vocabulary, block size, statistics
//
// This part does not use LibTorch, and must not share a process with it: Debian's SentencePiece
// carries its own copy of protobuf, whose exported symbols collide with the libprotobuf that
// LibTorch loads (the process crashes while loading). `moeplan data prepare` therefore runs in
// its own executable, moeplan-data.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace moeplan::executor {

inline constexpr int64_t kTokensSchemaVersion = 1;

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files
  std::string out_dir;
  std::string tokenizer;       // SentencePiece model to load; empty: train one on the inputs
  int64_t vocab_size = 0;      // for training a tokenizer; checked against a loaded one if set
  int64_t block_size = 0;
  std::string document_separator;  // a line equal to it ends a document ("%" in fortune files);
                                   // empty: each file is one document
  int threads = 1;
};

struct PrepareSummary {
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t blocks = 0;
  int64_t vocab_size = 0;
  double unigram_entropy_nats = 0;  // of the tokens in blocks, by their corpus frequencies
};

using ProgressFn = std::function<void(const std::string&)>;

// Throws InputError naming the option or file at fault.
PrepareSummary prepare_data(const PrepareOptions& options, const ProgressFn& progress = {});

}  // namespace moeplan::executor
