#pragma once
// Causal attention of one rank's part of each sequence under context parallelism
// (docs/architecture.md section 6, C): the sequence is cut into 2C chunks and rank c holds chunks
// c and 2C - 1 - c (the first and the last, and so on inwards), so that every rank has the same
// causal work; everything outside attention is token by token on those seq_len / C tokens.
// Attention needs every earlier chunk's keys and values, which the ranks of the context group
// pass each other as the plan's context_exchange says:
//   p2p         around a ring (Megatron-Core's default --cp-comm-type): C steps, each
//               attending to the key-value block in hand (the flash kernel, which also gives
//               the block's log-sum-exp) while the next one travels; the blocks' outputs are
//               merged by their log-sum-exps. Backward passes the blocks around again, each
//               with its key-value gradient, which every holder adds its part to (its flash
//               backward with the merged output) and which ends with the block's owner; a
//               rank keeps only its own block in between.
//   all_gather  the key-value blocks gathered whole first, one attention over them; gathered
//               again for the backward, their gradients reduce-scattered after.
// Every block is attended with its mask of positions (causal, and a sliding window where the
// model has one), so a block whose keys all lie ahead of a query row adds nothing to it;
// Megatron-Core skips those halves of a block, this computes them masked.

#include "moeplan/executor/libtorch.h"

#include <array>
#include <cstdint>
#include <utility>
#include <optional>
#include <vector>

#include "moeplan/core/parallel_config.h"
#include "moeplan/executor/ranks/collectives.h"

namespace moeplan::executor {

// The positions in the sequence of rank `rank`'s tokens, in the order it holds them:
// chunk rank, then chunk 2 ranks - 1 - rank, each seq_len / (2 ranks) long.
torch::Tensor context_positions(int64_t seq_len, int64_t ranks, int64_t rank);

class ContextAttention {
 public:
  // group: the context group (this rank's index in it is its chunk pair).
  ContextAttention(Communicator& group, ContextExchange exchange, int64_t seq_len, std::optional<int64_t> window);

  // This rank's tokens, [B, seq_len / C] of a whole [B, seq_len] (ids or labels).
  torch::Tensor local(const torch::Tensor& whole) const;
  const torch::Tensor& positions() const { return positions_[static_cast<size_t>(group_.rank())]; }

  // q [B, heads, seq_len / C, d] of this rank's tokens, k and v [B, key-value heads, seq_len / C, d]
  // (grouped-query heads unrepeated); the output is shaped like q, in q's type.
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

 private:
  // Keys and values of one block, or their gradients, and a pair of them on its way around the
  // ring: sent to the next rank while the previous rank's comes in.
  using Pair = std::pair<torch::Tensor, torch::Tensor>;
  struct Passing {
    std::array<Communicator::PendingTransfer, 2> sends, recvs;
  };
  Passing pass(const Pair& pair, int64_t tag);
  Pair finish(Passing& passing);
  torch::Tensor ring(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
  torch::Tensor gathered(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
  // The rank whose key-value block a ring step holds, and the additive mask of that rank's keys.
  int64_t owner(int64_t step) const;
  torch::Tensor mask(int64_t rank, torch::ScalarType type, torch::Device device) const;
  // The additive mask of every rank's keys, in the order the all-gather puts them.
  torch::Tensor whole_mask(torch::ScalarType type, torch::Device device) const;
  Communicator& group_;
  ContextExchange exchange_;
  std::vector<torch::Tensor> positions_;  // of every rank of the group
  // Per rank of the group: true where query i of this rank may not see that rank's key j.
  std::vector<torch::Tensor> hidden_;
};

}  // namespace moeplan::executor
