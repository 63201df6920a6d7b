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
    : group_(group), exchange_(exchange), window_(window) {
  for (int64_t r = 0; r < group.size(); ++r) positions_.push_back(context_positions(seq_len, group.size(), r));
}

torch::Tensor ContextAttention::local(const torch::Tensor& whole) const {
  return whole.index_select(1, positions().to(whole.device()));
}

torch::Tensor ContextAttention::hidden(int64_t from) const {
  const torch::Tensor q = positions().unsqueeze(1), k = positions_[static_cast<size_t>(from)].unsqueeze(0);
  torch::Tensor masked = k > q;
  if (window_) masked = masked | (q - k >= *window_);
  return masked;
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
  std::vector<torch::Tensor> masks;
  for (int64_t r = 0; r < group_.size(); ++r) masks.push_back(hidden(r));
  const torch::Tensor bias = torch::zeros({q.size(2), k.size(2) * group_.size()}, q.scalar_type())
                                 .masked_fill(torch::cat(masks, 1), -std::numeric_limits<float>::infinity())
                                 .to(q.device());
  return flash_attention(q, gather(k), gather(v), bias);
}

namespace {

// One key-value block's attention for every query row, in fp32: the output and the log-sum-exp
// of the row's scores. A masked score is a large finite negative, so that a row that sees none
// of the block gets a log-sum-exp far below every other block's and no weight in the merge.
std::pair<torch::Tensor, torch::Tensor> block_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                        const torch::Tensor& v, const torch::Tensor& masked) {
  const int64_t repeat = q.size(1) / k.size(1);
  const torch::Tensor keys = (repeat > 1 ? k.repeat_interleave(repeat, 1) : k).to(torch::kFloat);
  const torch::Tensor values = (repeat > 1 ? v.repeat_interleave(repeat, 1) : v).to(torch::kFloat);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const torch::Tensor scores =
      (torch::matmul(q.to(torch::kFloat), keys.transpose(-1, -2)) * scale).masked_fill(masked.to(q.device()), -1e30);
  const torch::Tensor lse = torch::logsumexp(scores, -1);
  return {torch::matmul(torch::exp(scores - lse.unsqueeze(-1)), values), lse};
}

constexpr int64_t kForwardTag = 0, kBackwardTag = 1;

// `received` (what the previous rank of the ring sent while this one sent `sent` on) made the
// differentiable image of `sent`: its gradient goes back to the previous rank, and `sent`'s
// comes from the next one.
torch::Tensor passed_on(Communicator& ring, const torch::Tensor& sent, const torch::Tensor& received) {
  TensorList out{received};
  const int64_t prev = (ring.rank() + ring.size() - 1) % ring.size(), next = (ring.rank() + 1) % ring.size();
  attach_backward({sent}, out, "RingPassBackward",
                  [&ring, prev, next, shape = received.sizes().vec(), type = received.scalar_type()](TensorList&& g) {
                    const torch::Tensor grad =
                        g[0].defined() ? g[0].contiguous() : torch::zeros(shape, torch::TensorOptions().dtype(type));
                    Communicator::PendingTransfer back = ring.start_send(grad, prev, kBackwardTag);
                    Communicator::PendingTransfer mine = ring.start_recv(shape, type, next, kBackwardTag);
                    torch::Tensor result = ring.finish_transfer(mine);
                    ring.finish_transfer(back);
                    return TensorList{result};
                  });
  return out[0];
}

}  // namespace

torch::Tensor ContextAttention::ring(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t ranks = group_.size(), me = group_.rank();
  const int64_t prev = (me + ranks - 1) % ranks, next = (me + 1) % ranks;
  torch::Tensor block = torch::stack({k, v});  // the key-value block in hand, [2, B, heads, T / C, d]
  std::vector<torch::Tensor> outs, lses;
  for (int64_t step = 0; step < ranks; ++step) {
    // The next block travels while this one is attended to.
    const bool more = step + 1 < ranks;
    Communicator::PendingTransfer send, recv;
    const torch::Tensor sending = block.detach().contiguous();
    if (more) {
      send = group_.start_send(sending, next, kForwardTag);
      recv = group_.start_recv(sending.sizes(), sending.scalar_type(), prev, kForwardTag);
    }
    auto [out, lse] = block_attention(q, block[0], block[1], hidden((me - step + ranks) % ranks));
    outs.push_back(out);
    lses.push_back(lse);
    if (more) {
      const torch::Tensor received = group_.finish_transfer(recv);
      group_.finish_transfer(send);
      block = passed_on(group_, block, received);
    }
  }
  const torch::Tensor lse = torch::stack(lses);                       // [C, B, heads, T / C]
  const torch::Tensor weights = torch::exp(lse - torch::logsumexp(lse, 0, /*keepdim=*/true)).unsqueeze(-1);
  return (weights * torch::stack(outs)).sum(0).to(q.scalar_type());
}

}  // namespace moeplan::executor
