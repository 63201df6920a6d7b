// moeplan-data: `moeplan data prepare` runs here, in a process without LibTorch.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "moeplan/core/errors.h"
#include "moeplan/core/exit_codes.h"
#include "moeplan/executor/io/data_prepare.h"

int main(int argc, char** argv) {
  using namespace moeplan;
  CLI::App app{"moeplan data: tokenize text and pack it into training blocks"};
  app.require_subcommand(1);
  executor::PrepareOptions o;
  CLI::App* prepare = app.add_subcommand("prepare", "Tokenize text with SentencePiece and pack it into fixed-length blocks");
  prepare->add_option("--input", o.inputs, "Text files")->required()->check(CLI::ExistingFile);
  prepare->add_option("--out", o.out_dir, "Output folder")->required();
  prepare->add_option("--tokenizer", o.tokenizer, "SentencePiece tokenizer.model to load (e.g. Mixtral's)")
      ->check(CLI::ExistingFile);
  prepare->add_option("--vocab-size", o.vocab_size, "Train a BPE tokenizer of this many pieces on the input")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  prepare->add_option("--block-size", o.block_size, "Tokens per training sample (the plan's seq_len)")
      ->required()->check(CLI::Range(int64_t{2}, int64_t{1} << 24));
  prepare->add_option("--document-separator", o.document_separator,
                      "A line equal to this ends a document (\"%\" in fortune files); default: one document per file");
  prepare->add_option("--threads", o.threads, "Threads for training the tokenizer")->check(CLI::Range(1, 1024));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitBadInput;
  }
  try {
    const executor::PrepareSummary s =
        executor::prepare_data(o, [](const std::string& line) { std::printf("data: %s\n", line.c_str()); });
    std::printf("data: %lld documents, %lld tokens, %lld blocks, vocabulary %lld, unigram entropy %.4f nats/token\n",
                static_cast<long long>(s.documents), static_cast<long long>(s.tokens),
                static_cast<long long>(s.blocks), static_cast<long long>(s.vocab_size), s.unigram_entropy_nats);
    return kExitOk;
  } catch (const InputError& e) {
    for (const std::string& line : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", line.c_str());
    return kExitBadInput;
  }
}
