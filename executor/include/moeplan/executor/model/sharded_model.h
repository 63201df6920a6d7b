#pragma once
// Mixtral spread over a device mesh (docs/architecture.md sections 6 and 10): experts partitioned over the
// expert group, model states sharded over the shard group as flat parameters, tokens moved to
// their experts by all-to-all or all-gather, activation checkpointing and offloading.
//
// Flat parameters (the planner's memory model counts the same units): the embedding; per
// decoder layer its dense part and, separately, its local experts (they are summed over
// different replica groups); the final norm with the lm head. Each is padded to a multiple of
// S and split into S equal shards; a rank keeps only its shard (the fp32 master, or bf16 in
// bf16 mode) and its AdamW moments. Before a unit is used its shards are all-gathered in the
// compute type (the next block's units move while a block computes); the gathered copy is
// freed after the unit's forward and gathered again for its backward, whose gradient is
// reduce-scattered back to the shards.
//
// Tensor parallelism (T > 1, always with sequence parallelism for MoE models, as Megatron-Core
// requires): a rank's units hold its part of each matrix (tensor_split), so the flat units
// above are of those parts. Between blocks the hidden states are split along the sequence
// over the T ranks; each block all-gathers the normed sequence, runs attention on its heads
// (q, k, v by rows, o by columns) and reduce-scatters the partial sum back to its part of the
// sequence, and likewise for the MoE block: every T rank routes the whole gathered sequence
// alike (so routing, load-balancing losses and counts are exactly those of one rank), its
// expert group moves the tokens to their experts, whose w1 and w3 are split by rows and w2 by
// columns, and the partial outputs are reduce-scattered. The embedding and lm head are split
// over the vocabulary (the loss is a vocabulary-parallel cross entropy). With the tensor ranks
// folded into the expert group (ETP = 1, parallel folding) the routed experts are whole instead,
// and each T rank routes its own part of the sequence (moe_sublayer).
//
// Context parallelism (C > 1): every rank of a context group is given the whole micro-batch and
// keeps its two chunks of each sequence (context_attention.h); rotary positions are those of its
// tokens, attention exchanges keys and values over the group, all else is token by token. The
// losses are those of the whole micro-batch on every rank of the group: the cross entropy's
// sums and the router's counts, probabilities and rows are summed over it (with the gradient of
// this rank's tokens), and sinkhorn balances the whole micro-batch. With E > 1 the expert group
// spans the context ranks (mesh.h).

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moeplan/core/plan.h"
#include "moeplan/executor/model/context_attention.h"
#include "moeplan/executor/model/element_runs.h"
#include "moeplan/executor/model/mixtral.h"
#include "moeplan/executor/model/offload.h"
#include "moeplan/executor/model/rehearsal_fault.h"
#include "moeplan/executor/model/routing_record.h"
#include "moeplan/executor/ranks/mesh.h"

namespace moeplan::executor {

struct FlatUnit {
  std::string name;  // "embed", "layers.3.dense", "layers.3.experts", "head"
  int64_t block = 0;
  bool experts = false;
  std::vector<int64_t> params;   // indices into the model's parameter list
  std::vector<int64_t> offsets;  // of each parameter in the flat tensor
  int64_t numel = 0;             // without padding
  int64_t shard_numel = 0;       // ceil(numel / S)
};

// The units of a rank at expert coordinate `expert_rank` (it holds experts
// [expert_rank * n, (expert_rank + 1) * n), n = num_experts / E).
std::vector<FlatUnit> flat_units(const ModelSpec& spec, const std::vector<ParamInfo>& infos, int64_t expert_degree,
                                 int64_t expert_rank, int64_t shard_degree);

class ShardedModel {
 public:
  // Builds the parameter list on the meta device, then materialises and initialises only this
  // rank's shards; the values are those of the one-rank model, whatever the layout.
  ShardedModel(const Plan& plan, DeviceMesh& mesh);

  const std::vector<ParamInfo>& infos() const { return infos_; }
  const std::vector<FlatUnit>& units() const { return units_; }
  // Master shards, one per unit, leaves that receive the reduce-scattered gradients.
  std::vector<torch::Tensor>& shards() { return shards_; }
  // The elements of each shard that take weight decay (matrices, not norms or padding).
  const std::vector<ElementRuns>& decay_runs() const { return decay_runs_; }
  // The group a unit's shard gradients are summed over after the reduce-scatter.
  Communicator& replica_group(const FlatUnit& unit);
  // Whether this rank counts the unit in a global sum (the gradient norm) or writes it to a
  // checkpoint: exactly one rank of its replicas does.
  bool owns(const FlatUnit& unit) const;
  // Where shard s of unit u starts in the flat tensor.
  int64_t shard_begin(const FlatUnit& unit) const { return mesh_.coords().s * unit.shard_numel; }
  // How parameter i is split over the tensor-parallel group (infos() holds this rank's part).
  TensorSplit split_of(int64_t param) const { return splits_[static_cast<size_t>(param)]; }
  // Whether every T rank holds parameter i whole and alike (norms, router; a folded expert is
  // whole but on one rank of its expert group only).
  bool alike_on_tensor_ranks(int64_t param) const {
    return splits_[static_cast<size_t>(param)] == TensorSplit::kWhole &&
           !(folded_ && infos_[static_cast<size_t>(param)].expert >= 0);
  }
  // With T > 1: the elements of unit u's shard that belong to parameters every T rank holds
  // whole and alike (norms, router); none when T = 1.
  const ElementRuns& whole_runs(size_t unit) const { return whole_runs_[unit]; }
  // g (unit u's gradient) without those elements where another T rank counts them: what this
  // rank adds to a sum over every parameter once (g itself where it counts them all).
  torch::Tensor counted_once(size_t unit, const torch::Tensor& g) const;
  // Sums over the tensor-parallel group the gradient of the parameters that every T rank holds
  // whole: each rank's is that of its part of the sequence.
  void sum_whole_parameter_grads(size_t unit, torch::Tensor& grad);

  // How many gradient reduce-scatters may be in flight while backward goes on: each unit's is
  // started when its gradient is made and finished (added to the shard's gradient) once more
  // than `in_flight` are started; finish_gradient_scatters() finishes the rest, before the
  // shards' gradients are read. 0: each finishes before backward goes on. By default 1 on a GPU
  // (the collective on its own stream beside the next block's backward, as the simulation has
  // it) and 0 on the CPU, whose ranks' cores the collective's threads would share.
  void set_scatters_in_flight(int64_t in_flight) { scatters_in_flight_ = in_flight; }
  // Every rank calls it alike (after its micro-batches' backward passes, and at a step's start,
  // where a failed step may have left some).
  void finish_gradient_scatters() { finish_scatters(0); }

  // Activations saved for backward at checkpoints go to `store` (nullptr: kept in memory).
  void set_offload(ActivationStore* store, int64_t horizon) {
    offload_ = store;
    horizon_ = horizon;
  }

  // One micro-batch [B, T] of this rank. shuffle_seed seeds the global token shuffle (the same on
  // every rank of an expert group). Router counts are of this rank's tokens.
  ForwardResult forward(const torch::Tensor& input_ids, uint64_t shuffle_seed);
  // The same through one chunk of this pipeline rank's layers: chunk c is virtual stage
  // c P + p of the P x V, layers [v L / (P V), (v + 1) L / (P V)). The first virtual stage
  // starts from input_ids, the others from `hidden` (the previous stage's output); the last
  // gives logits, the others `hidden`. Router logits and counts are of the chunk's layers.
  ForwardResult forward_chunk(int64_t chunk, const torch::Tensor& input_ids, const torch::Tensor& hidden,
                              uint64_t shuffle_seed);
  // Whether unit u lies on this rank's pipeline stage (the others have empty shards).
  bool holds(size_t unit) const { return held_[unit]; }
  // With multi-token prediction over pipeline stages, the last stage holds a copy of the
  // embedding (unit 0) for the modules' lookups, as Megatron-Core's does: both copies start
  // alike, their gradients are summed over the pipeline group (sum_shared_embedding_grads) and
  // so move alike; the first stage's is the one counted and saved (owns).
  bool shares_embedding() const { return shared_embedding_; }
  // Sums unit 0's gradient over the pipeline group: the first stage's lookups' and the last's
  // (a middle stage adds zeros). Every rank of the group calls it.
  void sum_shared_embedding_grads(torch::Tensor& grad);
  // The loss of a forward's result (with T > 1 the logits are this rank's part of the
  // vocabulary; every T rank gets the same loss).
  LossTerms loss(const ForwardResult& out, const torch::Tensor& input_ids);

  // A sigmoid router's balancing biases [moe blocks, experts], whole and equal on every rank
  // (expert_bias.h); undefined under softmax scoring.
  torch::Tensor& expert_bias() { return expert_bias_; }

  // Whether the routed experts are whole, the tensor-parallel ranks folded into the expert group
  // (ETP = 1 under T > 1): each T rank then routes its own part of the sequence.
  bool folded() const { return folded_; }

  // The most token-expert rows this rank's experts computed in one layer of one micro-batch
  // since the last call (the load its activations are sized by), and a new count.
  int64_t take_busiest_expert_rows() { return std::exchange(busiest_expert_rows_, 0); }

  // A rehearsal's layout (routing_record.h): the first tensor-parallel rank records every
  // layer's routing of the micro-batch in progress, numbered as set_micro_batch says.
  void record_routing(RoutingRecorder* recorder) { recorder_ = recorder; }
  void set_micro_batch(int64_t micro_batch) { micro_batch_ = micro_batch; }
  // A fault planted by a rehearsal's test hook (rehearsal_fault.h): the model plants
  // kExpertOnWrongRank, the trainer the others.
  void plant(RehearsalFault fault) { fault_ = fault; }

 private:
  struct Gathered {
    size_t unit = 0;
    torch::Tensor flat;                 // the whole unit in the compute type
    std::vector<torch::Tensor> params;  // views of flat, shaped like the parameters
    bool releasable = false;            // false when flat is the master shard itself
  };
  using BlockFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&, bool recompute)>;

  Gathered gather(size_t unit);
  // Starts a unit's all-gather, which gather(unit) then finishes: during forward the next
  // block's units move while a block computes, in forward and in backward.
  void prefetch(size_t unit);
  void prefetch_block(int64_t layer);  // layer == num_layers: the head
  void release(const Gathered& g);
  torch::Tensor regather_in_backward(const torch::Tensor& y, const std::vector<Gathered>& units);
  std::vector<torch::Tensor> checkpoint(BlockFn fn, const std::vector<torch::Tensor>& inputs, int64_t layer);
  torch::Tensor block(int64_t layer, const torch::Tensor& x, ForwardResult& out, uint64_t shuffle_seed);
  torch::Tensor dense_block(int64_t layer, const torch::Tensor& x);
  torch::Tensor moe_sublayer(int64_t layer, const torch::Tensor& h, const torch::Tensor& norm,
                             const torch::Tensor& router, const LayerWeights& shared, const Gathered& experts,
                             bool count, torch::Tensor& router_logits, uint64_t shuffle_seed);
  torch::Tensor moe(int64_t layer, const torch::Tensor& x, const torch::Tensor& router, const Gathered& experts,
                    bool count, torch::Tensor& router_logits, uint64_t shuffle_seed);
  torch::Tensor dispatch_all_to_all(const torch::Tensor& tokens, const SlotList& slots, const Gathered& local);
  torch::Tensor dispatch_all_gather(const torch::Tensor& tokens, const torch::Tensor& experts,
                                    const torch::Tensor& weights, const Gathered& local);
  torch::Tensor local_experts(const torch::Tensor& rows, const std::vector<int64_t>& rows_per_expert,
                              const Gathered& local);
  LayerWeights dense_weights(const Gathered& dense) const;
  // [B, T / tp, h] <-> [B, T, h] over the tensor-parallel group (identity when T = 1): the
  // all-gather's backward is a reduce-scatter and the other way round.
  torch::Tensor gather_sequence(const torch::Tensor& x);
  torch::Tensor scatter_sequence(const torch::Tensor& partial);
  torch::Tensor embed(const torch::Tensor& table, const torch::Tensor& input_ids);
  // This rank's tokens of a whole [B, T] micro-batch (ids or labels): all of them without
  // context parallelism.
  torch::Tensor local_tokens(const torch::Tensor& whole) const { return context_ ? context_->local(whole) : whole; }
  // The sum over the ranks that route parts of one micro-batch (routing.h), empty when alone.
  RankSum routing_sum();
  // A cross entropy's sum over this rank's counted tokens made the mean over the micro-batch's.
  torch::Tensor sequence_mean(const torch::Tensor& sum, const torch::Tensor& counted);

  const Plan& plan_;
  DeviceMesh& mesh_;
  torch::ScalarType master_type_, compute_type_;
  torch::Device device_;  // the mesh's: where the states and activations are
  std::vector<ParamInfo> infos_;  // this rank's part of each parameter
  std::vector<TensorSplit> splits_;
  ModelSpec local_spec_;  // the attention heads of this tensor-parallel rank
  int64_t tp_ = 1, tp_rank_ = 0;
  bool folded_ = false;  // the routed experts whole, the T ranks folded into the expert group
  int64_t pp_ = 1, pp_rank_ = 0, chunks_ = 1, layers_per_chunk_ = 1;
  std::vector<bool> held_;  // per unit: on this pipeline stage
  bool shared_embedding_ = false;  // the last stage holds the embedding too (shares_embedding)
  std::vector<ElementRuns> whole_runs_;
  std::vector<FlatUnit> units_;
  std::vector<torch::Tensor> shards_;
  std::vector<ElementRuns> decay_runs_;
  int64_t experts_per_rank_ = 0, first_expert_ = 0;
  Rope rope_;
  torch::Tensor mask_;
  int64_t cp_ = 1, seq_len_ = 0;
  std::unique_ptr<ContextAttention> context_;  // with C > 1, for the sequence length in use
  std::unique_ptr<ContextAttention> context_full_;  // the same without the window, where some blocks have none
  AttentionCore core_;       // causal flash attention (within the window, if any), or the context group's
  AttentionCore full_core_;  // the same over the whole sequence, for the blocks without the window
  const AttentionCore& core(int64_t block) const { return plan_.model.windowed(block) ? core_ : full_core_; }
  torch::Tensor routed_positions_;             // where this rank routes part of each sequence
  ActivationStore* offload_ = nullptr;
  int64_t horizon_ = 1;
  torch::Tensor expert_bias_;
  torch::Tensor tokens_per_expert_;  // of the forward in progress
  int64_t dropped_slots_ = 0;        // of those, dropped at capacity
  int64_t busiest_expert_rows_ = 0;
  std::map<size_t, Communicator::PendingGather> prefetched_;  // by unit
  // Gradient reduce-scatters started in backward, oldest first, with their units.
  std::deque<std::pair<size_t, Communicator::PendingScatter>> scattering_;
  int64_t scatters_in_flight_ = 0;
  void start_scatter(size_t unit, const torch::Tensor& grad);
  void finish_scatters(size_t keep);  // finishes the oldest until `keep` remain
  RoutingRecorder* recorder_ = nullptr;
  int64_t micro_batch_ = 0;
  RehearsalFault fault_ = RehearsalFault::kNone;
};

// The master and compute types of a precision.
torch::ScalarType master_type(Precision p);
torch::ScalarType compute_type(Precision p);

}  // namespace moeplan::executor
