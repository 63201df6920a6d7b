#pragma once
// Reading a data folder written by prepare_data (data_prepare.h) during training.

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moeplan::executor {

// A prepared data folder, memory-mapped. Opening checks the manifest against the files: sizes,
// checksums, the index (monotone, ending at the token count) and every token id < vocab_size.
class TokenDataset {
 public:
  static TokenDataset open(const std::string& dir);
  ~TokenDataset();
  TokenDataset(TokenDataset&&) noexcept;
  TokenDataset& operator=(TokenDataset&&) noexcept;

  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t num_tokens() const { return num_tokens_; }
  double unigram_entropy_nats() const { return unigram_entropy_nats_; }
  const std::string& dir() const { return dir_; }

  // Blocks as int64 ids [n, block_size].
  torch::Tensor blocks(const std::vector<int64_t>& indices) const;

 private:
  TokenDataset() = default;
  std::string dir_;
  int64_t block_size_ = 0, num_blocks_ = 0, vocab_size_ = 0, num_tokens_ = 0, token_bytes_ = 2;
  double unigram_entropy_nats_ = 0;
  const unsigned char* data_ = nullptr;
  size_t mapped_bytes_ = 0;
};

// Which block the n-th sample of a run reads: a fresh permutation of the blocks every epoch,
// from (seed, epoch) only, so a resumed run continues at the right sample.
class BlockOrder {
 public:
  BlockOrder(int64_t num_blocks, uint64_t seed) : num_blocks_(num_blocks), seed_(seed) {}
  int64_t block_of(int64_t sample);

 private:
  int64_t num_blocks_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> permutation_;
};

}  // namespace moeplan::executor
