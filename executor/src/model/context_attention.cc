#include "moeplan/executor/model/context_attention.h"

#include <cmath>

#include "moeplan/executor/model/autograd_ops.h"
#include "moeplan/executor/model/kernels.h"

namespace moeplan::executor {

torch::Tensor context_positions(int64_t seq_len, int64_t ranks, int64_t rank) {
  const int64_t chunk = seq_len / (2 * ranks);
  return torch::cat({torch::arange(rank * chunk, (rank + 1) * chunk, torch::kLong),
                     torch::arange((2 * ranks - 1 - rank) * chunk, (2 * ranks - rank) * chunk, torch::kLong)});
}

ContextAttention::ContextAttention(Communicator& group, ContextExchange exchange, int64_t seq_len,
                                   std::optional<int64_t> window)
    : group_(group), exchange_(exchange) {
  for (int64_t r = 0; r < group.size(); ++r) positions_.push_back(context_positions(seq_len, group.size(), r));
  // What each rank's keys hide from this rank's queries, made once for the sequence length.
  const torch::Tensor q = positions().unsqueeze(1);
  for (int64_t r = 0; r < group.size(); ++r) {
    const torch::Tensor k = positions_[static_cast<size_t>(r)].unsqueeze(0);
    torch::Tensor masked = k > q;
    if (window) masked = masked | (q - k >= *window);
    hidden_.push_back(masked);
  }
}

torch::Tensor ContextAttention::local(const torch::Tensor& whole) const {
  return whole.index_select(1, positions().to(whole.device()));
}

torch::Tensor ContextAttention::attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (group_.size() == 1) return flash_attention(q, k, v, torch::Tensor());
  return exchange_ == ContextExchange::kAllGather ? gathered(q, k, v) : ring(q, k, v);
}

torch::Tensor ContextAttention::gathered(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  // The collectives work along dimension 0: the sequence goes first for the move.
  auto gather = [this](const torch::Tensor& t) {
    return all_gather_autograd(group_, t.permute({2, 0, 1, 3}).contiguous()).permute({1, 2, 0, 3});
  };
  const torch::Tensor bias = torch::zeros({q.size(2), k.size(2) * group_.size()}, q.scalar_type())
                                 .masked_fill(torch::cat(hidden_, 1), -std::numeric_limits<float>::infinity())
                                 .to(q.device());
  return flash_attention(q, gather(k), gather(v), bias);
}

namespace {

constexpr int64_t kForwardTag = 0, kBackwardTag = 1;
// A masked score: large and negative but finite, so that a query row that sees none of a block
// gets a log-sum-exp far below the other blocks' and no weight in the merge (a row of -inf would
// make the block's output NaN).
constexpr double kHidden = -1e30;

}  // namespace

// Each step attends to the block in hand with the flash kernel, which gives the block's output
// and log-sum-exp; the outputs are merged by their log-sum-exps. Backward, the flash backward of
// each block with the merged output and log-sum-exp gives the block's part of every gradient
// (the merged softmax is the blocks' joined), and the key-value gradients go back around the
// ring, each rank adding its part for the block's owner as the buffer passes (as Megatron-Core's
// ring attention does). What backward keeps: q, the C key-value blocks, the merged output and
// log-sum-exp; no score matrix.
torch::Tensor ContextAttention::ring(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t ranks = group_.size(), me = group_.rank();
  const int64_t prev = (me + ranks - 1) % ranks, next = (me + 1) % ranks;
  const torch::Tensor qd = q.detach();
  std::vector<torch::Tensor> keys{k.detach().contiguous()}, values{v.detach().contiguous()}, masks;
  torch::Tensor out, lse;  // merged so far, fp32
  for (int64_t step = 0; step < ranks; ++step) {
    // The next block travels while this one is attended to.
    const bool more = step + 1 < ranks;
    Communicator::PendingTransfer send, recv;
    const torch::Tensor block = torch::stack({keys.back(), values.back()});
    if (more) {
      send = group_.start_send(block, next, kForwardTag);
      recv = group_.start_recv(block.sizes(), block.scalar_type(), prev, kForwardTag);
    }
    masks.push_back(torch::zeros({q.size(2), k.size(2)}, q.scalar_type())
                        .masked_fill(hidden_[static_cast<size_t>((me - step + ranks) % ranks)], kHidden)
                        .to(q.device()));
    torch::Tensor o, l;
    std::tie(o, l) = at::_scaled_dot_product_flash_attention_for_cpu(qd, keys.back(), values.back(), 0.0, false,
                                                                      masks.back());
    if (step == 0) {
      out = o.to(torch::kFloat);
      lse = l;
    } else {
      const torch::Tensor merged = torch::logaddexp(lse, l);
      out = out * torch::exp(lse - merged).unsqueeze(-1) + o.to(torch::kFloat) * torch::exp(l - merged).unsqueeze(-1);
      lse = merged;
    }
    if (more) {
      const torch::Tensor received = group_.finish_transfer(recv);
      group_.finish_transfer(send);
      keys.push_back(received[0]);
      values.push_back(received[1]);
    }
  }
  TensorList outputs{out.to(q.scalar_type())};
  attach_backward(
      {q, k, v}, outputs, "RingAttentionBackward",
      [this, qd, keys, values, masks, out, lse, ranks, prev, next](TensorList&& grads) {
        const auto fp32 = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
        const torch::Tensor d_out = grads[0].defined() ? fp32(grads[0]) : torch::zeros_like(out);
        torch::Tensor dq = torch::zeros_like(out), own_k, own_v;
        std::vector<torch::Tensor> dk, dv;  // per step: the gradient of the block held then
        for (int64_t step = 0; step < ranks; ++step) {
          auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
              d_out, fp32(qd), fp32(keys[static_cast<size_t>(step)]), fp32(values[static_cast<size_t>(step)]), out,
              lse, 0.0, false, fp32(masks[static_cast<size_t>(step)]));
          dq += gq;
          dk.push_back(gk);
          dv.push_back(gv);
        }
        // The buffer for the block of rank c - 1 starts here with step 1's part, and each rank it
        // passes adds the part its step held that block at; after C - 1 hops it reaches its owner.
        torch::Tensor buffer = torch::stack({dk[1], dv[1]});
        torch::Tensor mine;
        for (int64_t hop = 1; hop < ranks; ++hop) {
          Communicator::PendingTransfer send = group_.start_send(buffer, next, kBackwardTag);
          Communicator::PendingTransfer recv = group_.start_recv(buffer.sizes(), buffer.scalar_type(), prev, kBackwardTag);
          const torch::Tensor received = group_.finish_transfer(recv);
          group_.finish_transfer(send);
          if (hop + 1 < ranks)
            buffer = received + torch::stack({dk[static_cast<size_t>(hop + 1)], dv[static_cast<size_t>(hop + 1)]});
          else
            mine = received;
        }
        const torch::ScalarType type = qd.scalar_type();
        return TensorList{dq.to(type), (dk[0] + mine[0]).to(type), (dv[0] + mine[1]).to(type)};
      });
  return outputs[0];
}

}  // namespace moeplan::executor
