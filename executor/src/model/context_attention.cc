#include "moeplan/executor/model/context_attention.h"

#include <cmath>
#include <optional>

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

// The key-value blocks gathered for the forward are let go after it and gathered again for the
// backward (as Transformer Engine's AttnFuncWithCPAndKVAllGather does), so that what backward keeps
// -- q, this rank's own keys and values, the output and its log-sum-exp -- does not grow with the
// whole sequence; the whole sequence's key-value gradients are reduce-scattered to their owners.
torch::Tensor ContextAttention::gathered(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  // The collectives work along dimension 0: the sequence goes first for the move.
  auto gather = [this](const torch::Tensor& t) {
    return group_.all_gather(t.permute({2, 0, 1, 3}).contiguous()).permute({1, 2, 0, 3});
  };
  auto scatter = [this](const torch::Tensor& t) {
    return group_.reduce_scatter_sum(t.permute({2, 0, 1, 3}).contiguous()).permute({1, 2, 0, 3});
  };
  const torch::Tensor qd = q.detach(), kd = k.detach(), vd = v.detach();
  torch::Tensor out, lse;
  std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(qd, gather(kd), gather(vd), 0.0, false,
                                                                        whole_mask(q.scalar_type(), q.device()));
  TensorList outputs{out};
  attach_backward({q, k, v}, outputs, "GatheredAttentionBackward",
                  [this, qd, kd, vd, out, lse, gather, scatter](TensorList&& grads) {
                    const auto fp32 = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
                    const torch::Tensor d_out = grads[0].defined() ? fp32(grads[0]) : torch::zeros_like(fp32(out));
                    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
                        d_out, fp32(qd), fp32(gather(kd)), fp32(gather(vd)), fp32(out), lse, 0.0, false,
                        whole_mask(torch::kFloat, out.device()));
                    const torch::ScalarType type = qd.scalar_type();
                    return TensorList{gq.to(type), scatter(gk.to(type)), scatter(gv.to(type))};
                  });
  return outputs[0];
}

namespace {

constexpr int64_t kForwardTag = 0, kBackwardTag = 1, kGradientTag = 2;
// A masked score: large and negative but finite, so that a query row that sees none of a block
// gets a log-sum-exp far below the other blocks' and no weight in the merge (a row of -inf would
// make the block's output NaN).
constexpr double kHidden = -1e30;

}  // namespace

// Each step attends to the block in hand with the flash kernel, which gives the block's output
// and log-sum-exp; the outputs are merged by their log-sum-exps. Backward keeps what
// Megatron-Core's ring attention (Transformer Engine's AttnFuncWithCPAndKVP2P) keeps: q, this
// rank's own key-value block, the merged output and log-sum-exp -- no other rank's block and no
// score matrix, so nothing grows with the whole sequence. Backward passes the blocks around the
// ring again, each with the key-value gradient its holders have added so far: the flash backward
// of the block in hand with the merged output and log-sum-exp gives that block's part of every
// gradient (the merged softmax is the blocks' joined); after C steps each block's gradient is
// back with its owner. Each of the C - 1 hops moves a block and its gradient: twice the forward's
// bytes in fp32 training (the gradients travel in fp32: three times with bf16 blocks). A hop's
// gradient goes after the step's flash backward and travels while the next step computes.
torch::Tensor ContextAttention::ring(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t ranks = group_.size();
  const torch::Tensor qd = q.detach();
  const Pair own{k.detach().contiguous(), v.detach().contiguous()};
  Pair block = own;
  torch::Tensor out, lse;  // merged so far, fp32
  for (int64_t step = 0; step < ranks; ++step) {
    // The next block travels while this one is attended to.
    Passing passing = step + 1 < ranks ? pass(block, kForwardTag) : Passing{};
    torch::Tensor o, l;
    std::tie(o, l) = at::_scaled_dot_product_flash_attention_for_cpu(qd, block.first, block.second, 0.0, false,
                                                                      mask(owner(step), q.scalar_type(), q.device()));
    if (step == 0) {
      out = o.to(torch::kFloat);
      lse = l;
    } else {
      const torch::Tensor merged = torch::logaddexp(lse, l);
      out = out * torch::exp(lse - merged).unsqueeze(-1) + o.to(torch::kFloat) * torch::exp(l - merged).unsqueeze(-1);
      lse = merged;
    }
    if (step + 1 < ranks) block = finish(passing);
  }
  TensorList outputs{out.to(q.scalar_type())};
  attach_backward({q, k, v}, outputs, "RingAttentionBackward", [this, qd, own, out, lse, ranks](TensorList&& grads) {
    const auto fp32 = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
    const torch::Tensor d_out = grads[0].defined() ? fp32(grads[0]) : torch::zeros_like(out);
    const torch::Tensor q32 = fp32(qd);
    torch::Tensor dq = torch::zeros_like(out);
    Pair block = own, mine;
    std::optional<Passing> moving;  // the last gradient sent on, and the previous rank's coming in
    for (int64_t step = 0; step < ranks; ++step) {
      // The block goes on before its gradient is known; the gradient follows it.
      Passing passing = step + 1 < ranks ? pass(block, kBackwardTag) : Passing{};
      auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          d_out, q32, fp32(block.first), fp32(block.second), out, lse, 0.0, false,
          mask(owner(step), torch::kFloat, out.device()));
      dq += gq;
      if (step == 0) {
        mine = {gk, gv};  // this rank's part for its own block, added when the others' comes back
      } else {
        // The gradient of the block in hand goes to the next rank, which holds that block a step
        // later (after the last step: its owner), while this rank computes its next step; the
        // one coming in is that of its block in hand (after the last step: the other ranks'
        // parts for its own).
        Pair gradient{gk, gv};
        if (moving) {
          const Pair before = finish(*moving);
          gradient = {before.first + gk, before.second + gv};
        }
        moving = pass(gradient, kGradientTag);
      }
      if (step + 1 < ranks) block = finish(passing);
    }
    const Pair others = finish(*moving);
    const torch::ScalarType type = qd.scalar_type();
    return TensorList{dq.to(type), (mine.first + others.first).to(type), (mine.second + others.second).to(type)};
  });
  return outputs[0];
}

// Keys and values (or their gradients) go as two transfers, started together: no joined copy.
ContextAttention::Passing ContextAttention::pass(const Pair& pair, int64_t tag) {
  const int64_t ranks = group_.size(), me = group_.rank();
  const int64_t prev = (me + ranks - 1) % ranks, next = (me + 1) % ranks;
  Passing p;
  p.sends = {group_.start_send(pair.first, next, tag), group_.start_send(pair.second, next, tag)};
  p.recvs = {group_.start_recv(pair.first.sizes(), pair.first.scalar_type(), prev, tag),
             group_.start_recv(pair.second.sizes(), pair.second.scalar_type(), prev, tag)};
  return p;
}

ContextAttention::Pair ContextAttention::finish(Passing& p) {
  Pair received{group_.finish_transfer(p.recvs[0]), group_.finish_transfer(p.recvs[1])};
  group_.finish_transfer(p.sends[0]);
  group_.finish_transfer(p.sends[1]);
  return received;
}

int64_t ContextAttention::owner(int64_t step) const {
  return (group_.rank() - step + group_.size()) % group_.size();
}

torch::Tensor ContextAttention::whole_mask(torch::ScalarType type, torch::Device device) const {
  const torch::Tensor hidden = torch::cat(hidden_, 1);
  return torch::zeros(hidden.sizes(), type).masked_fill(hidden, kHidden).to(device);
}

torch::Tensor ContextAttention::mask(int64_t rank, torch::ScalarType type, torch::Device device) const {
  return torch::zeros(hidden_[static_cast<size_t>(rank)].sizes(), type)
      .masked_fill(hidden_[static_cast<size_t>(rank)], kHidden)
      .to(device);
}

}  // namespace moeplan::executor
