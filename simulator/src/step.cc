#include "moeplan/simulator/step.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <span>
#include <stdexcept>

#include "moeplan/core/moe_load.h"
#include "moeplan/core/phases.h"
#include "moeplan/core/units.h"
#include "moeplan/simulator/op_costs.h"
#include "moeplan/simulator/pipeline.h"

namespace moeplan::sim {

namespace {

// Micro-batches simulated before the step is extrapolated: the first warms the streams up, the
// second gives the period, the third is the last one (shorter: nothing follows it).
constexpr int64_t kSimulatedMicroBatches = 3;

// The simulated ranks and, for each mesh dimension, the collectives of their groups.
class Layout {
 public:
  Layout(const RunConfig& c, bool all_ranks) : c_(c) {
    const ParallelConfig& p = c.parallel;
    const int64_t node_ranks = std::min(p.world_size, c.cluster.gpus_per_node);
    const int64_t count = all_ranks ? p.world_size : node_ranks;
    for (int64_t r = 0; r < count; ++r) ranks_.push_back(r);
    nodes_ = all_ranks ? static_cast<int32_t>((p.world_size + node_ranks - 1) / node_ranks) : 1;
    node_ranks_ = node_ranks;
    for (MeshDim d : kAllMeshDims) {
      const std::array<MeshDim, 1> one{d};
      groups_[static_cast<size_t>(d)] = find_groups(one);
    }
    shard_span_ = find_groups(kShardSpanDims);
  }

  const std::vector<int64_t>& ranks() const { return ranks_; }
  int32_t nodes() const { return nodes_; }
  int64_t coord(int64_t rank, MeshDim d) const {
    return (rank / c_.parallel.stride(d)) % c_.parallel.degree(d);
  }

  // The groups along one mesh dimension that have simulated members: which group each
  // simulated rank is in, how many simulated members each has, and the simulated nodes whose
  // card it crosses when it spans nodes.
  struct Groups {
    std::vector<int32_t> of_rank;
    std::vector<int32_t> parts;
    std::vector<std::vector<int32_t>> nodes;
  };
  const Groups& groups(MeshDim d) const { return groups_[static_cast<size_t>(d)]; }
  // The groups over S x E x C, where the dense parameters' shard spans the expert and context
  // ranks.
  const Groups& shard_span_groups() const { return shard_span_; }

 private:
  // The groups of ranks that differ only along `dims`.
  Groups find_groups(std::span<const MeshDim> dims) const {
    const ParallelConfig& p = c_.parallel;
    // A group's members: its smallest rank plus each combination of offsets along `dims`.
    std::vector<int64_t> offsets = {0};
    for (MeshDim d : dims) {
      std::vector<int64_t> wider;
      for (int64_t i = 0; i < p.degree(d); ++i)
        for (int64_t o : offsets) wider.push_back(o + i * p.stride(d));
      offsets = std::move(wider);
    }
    Groups g;
    std::map<int64_t, int32_t> index_of_base;  // a group is known by its smallest rank
    for (int64_t rank : ranks_) {
      int64_t base = rank;
      for (MeshDim d : dims) base -= coord(rank, d) * p.stride(d);
      auto [it, fresh] = index_of_base.try_emplace(base, static_cast<int32_t>(g.parts.size()));
      g.of_rank.push_back(it->second);
      if (!fresh) continue;
      int32_t parts = 0;
      std::vector<int32_t> nodes;
      for (int64_t offset : offsets) {
        const int64_t member = base + offset;
        if (member < static_cast<int64_t>(ranks_.size())) ++parts;
        const auto node = static_cast<int32_t>(member / node_ranks_);
        if (node < nodes_ && std::find(nodes.begin(), nodes.end(), node) == nodes.end()) nodes.push_back(node);
      }
      g.parts.push_back(parts);
      g.nodes.push_back(std::move(nodes));
    }
    return g;
  }

  const RunConfig& c_;
  std::vector<int64_t> ranks_;
  int32_t nodes_ = 1;
  int64_t node_ranks_ = 1;
  std::array<Groups, kMeshDims> groups_;
  Groups shard_span_;
};

class Builder {
 public:
  Builder(const RunConfig& c, const Layout& layout, int64_t micro_batches)
      : c_(c),
        p_(c.parallel),
        layout_(layout),
        cost_(c.cluster),
        o_(op_costs(c)),
        cover_(exchange_cover(o_)),
        shared_(shared_expert_cover(c, o_)),
        fold_per_node_(c.parallel.expert_fold() > 1
                           ? group_shape(c.cluster, c.parallel.world_size, c.parallel.expert_fold(),
                                         c.parallel.expert_stride())
                                 .per_node
                           : 1),
        shapes_(layout_shapes(c.cluster, c.parallel)),
        context_(context_exchange_cost(cost_, o_, c.parallel, shapes_.context)),
        graph_(static_cast<int32_t>(layout.ranks().size()), layout.nodes()),
        micro_batches_(micro_batches),
        layers_(static_cast<int>(c.model.blocks())),
        overlap_sync_(c.cluster.gradient_sync_overlaps_backward()),
        grad_scale_(c.training.precision == Precision::kMixed && c.training.fp32_gradients ? 2.0 : 1.0) {
    for (int64_t rank : layout.ranks()) {
      // The rank's place in its expert group: folded tensor ranks (ETP apart) innermost, then
      // the context ranks it spans.
      const int64_t folded =
          (p_.expert_spans_context() ? layout.coord(rank, MeshDim::kContext) * p_.tensor_parallel_degree : 0) +
          layout.coord(rank, MeshDim::kTensor);
      const int64_t e = layout.coord(rank, MeshDim::kExpert) * p_.expert_fold() +
                        folded / p_.expert_tensor_degree() % p_.expert_fold();
      const double load = expert_rank_load(c.model, c.moe, p_.expert_parallel_degree, e);
      moe_by_rank_.push_back(moe_forward_seconds(c, load));
      moe_backward_by_rank_.push_back(moe_backward_seconds(c, load));
    }
  }

  StepGraph build() {
    const size_t n = layout_.ranks().size();
    // Collectives must be issued in the same order on every rank, as NCCL requires: build
    // op by op across ranks, not rank by rank.
    RankState init;
    std::vector<RankState> state(n, init);
    for (auto& s : state) {
      s.fwd_done.assign(static_cast<size_t>(layers_), kNoOp);
      s.bwd_done.assign(static_cast<size_t>(layers_), kNoOp);
      s.offloaded.assign(static_cast<size_t>(layers_), kNoOp);
    }
    synced_.assign(n, kNoOp);
    for (int64_t mb = 0; mb < micro_batches_; ++mb) {
      // On GPUs each unit's gradients leave for the replicas as soon as the last micro-batch's
      // backward has finished them (DDP buckets, Megatron's overlapped gradient reduction);
      // where communication takes the compute's processor they follow the whole step.
      const bool last = mb + 1 == micro_batches_ && overlap_sync_;
      for (int l = 0; l < layers_; ++l) forward_layer(state, static_cast<int16_t>(mb), l);
      std::vector<OpId> head_gathered(n, kNoOp);
      if (dense_sharded()) {
        // The final norm and lm head, gathered for forward and again for backward.
        for (size_t r = 0; r < n; ++r) head_gathered[r] = layers_ >= 2 ? state[r].fwd_done[static_cast<size_t>(layers_ - 2)] : kNoOp;
        for (int pass = 0; pass < 2; ++pass)
          gather(head_gathered, OpKind::kGatherForward, -1, mb, o_.head_unit_bytes, true);
      }
      for (size_t r = 0; r < n; ++r) {
        Op head = compute(r, OpKind::kHeadForwardBackward, -1, mb, o_.head_s, 3.0 * o_.head_flops);
        state[r].last = graph_.add_op(head);
        graph_.depend(state[r].last, state[r].layer_out);
        graph_.depend(state[r].last, head_gathered[r]);
      }
      if (dense_sharded()) reduce_scatter(state, -1, mb, o_.head_unit_bytes, true);
      else
        for (RankState& st : state) st.last_grad = st.last;
      if (last) sync_unit(state, o_.head_unit_bytes, true);
      for (int l = layers_ - 1; l >= 0; --l) {
        backward_layer(state, static_cast<int16_t>(mb), l);
        if (last) sync_block(state, l);
      }
      if (dense_sharded()) reduce_scatter(state, -1, mb, o_.embed_unit_bytes, true);
      else
        for (RankState& st : state) st.last_grad = st.last;
      if (last) sync_unit(state, o_.embed_unit_bytes, true);
    }
    if (!overlap_sync_) {
      // Unit by unit, as the executor does, after the step's last backward.
      sync_unit(state, o_.embed_unit_bytes, true);
      for (int l = 0; l < layers_; ++l) sync_block(state, l);
      sync_unit(state, o_.head_unit_bytes, true);
    }
    for (size_t r = 0; r < n; ++r) {
      const OpId opt = graph_.add_op(compute(r, OpKind::kOptimizer, -1, -1, o_.optimizer_s, 0));
      graph_.depend(opt, state[r].last);
      graph_.depend(opt, synced_[r]);
      synced_[r] = opt;
    }
    // The distributed optimizer gathers the updated parameters back over the replicas. The
    // next step's forward waits only for the first unit (Megatron's overlapped parameter
    // gather); the others arrive behind its compute.
    if (p_.distributed_optimizer && p_.replica_degree() > 1) {
      const double bytes = o_.embed_unit_bytes / static_cast<double>(p_.dense_shard_degree());
      collective_round(synced_, MeshDim::kReplica, OpKind::kGatherForward, TraceStream::kGradComm, -1, -1,
                       cost_.all_gather_cost(bytes, shapes_.replica), bytes, true);
    }
    return std::move(graph_);
  }

 private:
  struct RankState {
    OpId last = kNoOp;        // the latest op of the rank's compute chain
    OpId layer_out = kNoOp;   // the output of the latest forward block
    OpId last_grad = kNoOp;   // the latest gradient collective
    std::vector<OpId> fwd_done, bwd_done, offloaded;
  };

  // One unit's gradient shard (`unit_bytes` / its shard degree) across the replicas: a dense
  // unit's over E, C then R, an expert unit's over R (and C where the expert group does not
  // span it); where the dense shard spans E and C, every unit's over R alone. All-reduced, or
  // reduce-scattered under the distributed optimizer (which gathers the parameters back after
  // the update).
  void sync_unit(const std::vector<RankState>& state, double unit_bytes, bool dense) {
    const double shards = static_cast<double>(dense ? p_.dense_shard_degree() : p_.expert_shard_degree());
    const double bytes = unit_bytes * grad_scale_ / shards;
    const bool spanned = p_.dense_shard_spanning();
    // After the unit's gradients are complete (its reduce-scatter, or the backward op); the
    // gradient stream keeps the syncs in issue order.
    for (size_t r = 0; r < state.size(); ++r) synced_[r] = state[r].last_grad;
    const bool scatter = p_.distributed_optimizer;
    auto cost = [&](const GroupShape& g) {
      return scatter ? cost_.reduce_scatter_cost(bytes, g) : cost_.all_reduce_cost(bytes, g);
    };
    if (dense && !spanned)
      collective_round(synced_, MeshDim::kExpert, OpKind::kGradAllReduce, TraceStream::kGradComm, -1, -1,
                       cost(shapes_.expert), bytes, true);
    // The context ranks hold the same dense parameters, and the same experts where the expert
    // group does not span them.
    if (!spanned && (dense || !p_.expert_spans_context()))
      collective_round(synced_, MeshDim::kContext, OpKind::kGradAllReduce, TraceStream::kGradComm, -1, -1,
                       cost(shapes_.context), bytes, true);
    collective_round(synced_, MeshDim::kReplica, OpKind::kGradAllReduce, TraceStream::kGradComm, -1, -1,
                     cost(shapes_.replica), bytes, true);
  }

  // Block l's units: an MoE block's dense part and its experts, or a dense block whole.
  void sync_block(const std::vector<RankState>& state, int l) {
    if (!moe_block(l)) {
      sync_unit(state, o_.dense_block_unit_bytes, true);
      return;
    }
    sync_unit(state, o_.dense_unit_bytes, true);
    sync_unit(state, o_.expert_unit_bytes, false);
  }

  // Whether block l of the stage has routed experts (its dense blocks come first).
  bool moe_block(int l) const { return c_.model.moe_layer(l); }

  Op compute(size_t r, OpKind kind, int layer, int64_t mb, double seconds, double flops) const {
    Op op;
    op.rank = static_cast<int32_t>(r);
    op.stream = TraceStream::kCompute;
    op.kind = kind;
    op.layer = static_cast<int16_t>(layer);
    op.micro_batch = static_cast<int16_t>(mb);
    op.duration = to_sim_time(seconds);
    op.flops = flops;
    return op;
  }

  // A block's kept activations to or from host memory.
  Op copy(size_t r, OpKind kind, int layer, int64_t mb) const {
    Op op = compute(r, kind, layer, mb, cost_.pcie_seconds(o_.offload_bytes), 0);
    op.stream = TraceStream::kCopy;
    op.bytes = o_.offload_bytes;
    return op;
  }

  // One collective per group along d, with a part on every simulated member; each part
  // depends on after[r] and replaces it.
  void collective_round(std::vector<OpId>& after, MeshDim d, OpKind kind, TraceStream stream, int layer, int64_t mb,
                        const CollectiveCost& cost, double bytes, bool skip_single, bool timed_in_place = false) {
    if (skip_single && p_.degree(d) <= 1) return;
    collective_round_in(layout_.groups(d), after, kind, stream, layer, mb, cost, bytes, timed_in_place);
  }

  // The same over the given groups.
  void collective_round_in(const Layout::Groups& groups, std::vector<OpId>& after, OpKind kind, TraceStream stream,
                           int layer, int64_t mb, const CollectiveCost& cost, double bytes, bool timed_in_place) {
    std::vector<int32_t> collective_of_group(groups.parts.size(), -1);
    const SimTime latency = to_sim_time(cost.latency_s);
    const SimTime intra = to_sim_time(cost.intra_s);
    const size_t n = layout_.ranks().size();
    for (size_t r = 0; r < n; ++r) {
      const auto g = static_cast<size_t>(groups.of_rank[r]);
      if (collective_of_group[g] < 0)
        collective_of_group[g] = graph_.add_collective(latency, intra, cost.nic_bytes_per_node, groups.nodes[g],
                                                       groups.parts[g], timed_in_place);
      Op op;
      op.rank = static_cast<int32_t>(r);
      op.stream = stream;
      op.kind = kind;
      op.layer = static_cast<int16_t>(layer);
      op.micro_batch = static_cast<int16_t>(mb);
      op.collective = collective_of_group[g];
      op.bytes = bytes;
      const OpId id = graph_.add_op(op);
      graph_.depend(id, after[r]);
      after[r] = id;
    }
  }

  // Whether the dense parameters, or the routed experts, are sharded.
  bool dense_sharded() const { return p_.dense_shard_degree() > 1; }
  bool experts_sharded() const { return p_.expert_shard_degree() > 1; }
  // The groups a dense unit, or an expert unit, is sharded over: S, or S x E x C where the
  // dense shard spans them (the experts' too where they are sharded over as many ranks).
  const Layout::Groups& shard_groups(bool dense) const {
    const bool spanned = p_.dense_shard_spanning() && (dense || p_.expert_shard_degree() == p_.dense_shard_degree());
    return spanned ? layout_.shard_span_groups() : layout_.groups(MeshDim::kShard);
  }
  const GroupShape& shard_shape(bool dense) const {
    return dense ? shapes_.dense_shard(p_) : shapes_.expert_shard(p_);
  }

  // A gather of a unit's `bytes` over its shard group after `after[r]`, which it replaces.
  // Where the whole micro-batch was measured sharded (OpCosts::shard_measured) the gather
  // takes `measured`, its share of what that measurement took beyond one rank's.
  void gather(std::vector<OpId>& after, OpKind kind, int layer, int64_t mb, double bytes, bool dense,
              double measured = 0) {
    if (!(dense ? dense_sharded() : experts_sharded())) return;
    collective_round_in(shard_groups(dense), after, kind, TraceStream::kShardGather, layer, mb,
                        o_.shard_measured ? CollectiveCost{0, measured, 0} : cost_.all_gather_cost(bytes, shard_shape(dense)),
                        bytes, o_.shard_measured);
  }

  // A gradient reduce-scatter of a unit (`bytes` in the compute dtype) over its shard group
  // after the rank's latest compute.
  void reduce_scatter(std::vector<RankState>& state, int layer, int64_t mb, double unit_bytes, bool dense) {
    const double bytes = unit_bytes * grad_scale_;
    std::vector<OpId> chain(state.size());
    for (size_t r = 0; r < state.size(); ++r) chain[r] = state[r].last;
    if (dense ? dense_sharded() : experts_sharded())
      collective_round_in(shard_groups(dense), chain, OpKind::kReduceScatter, TraceStream::kGradComm, layer, mb,
                          o_.shard_measured ? CollectiveCost{} : cost_.reduce_scatter_cost(bytes, shard_shape(dense)),
                          bytes, o_.shard_measured);
    for (size_t r = 0; r < state.size(); ++r) state[r].last_grad = chain[r];
  }

  // A token exchange inside the expert group, on the compute chain (the experts wait for it).
  // Before a dispatch (forward or recomputed) the ranks all-gather how many tokens each sends
  // to each expert, which sets the exchange's split sizes.
  void exchange(std::vector<RankState>& state, OpKind kind, int layer, int64_t mb) {
    std::vector<OpId> after(state.size());
    for (size_t r = 0; r < state.size(); ++r) after[r] = state[r].last;
    // A folded expert group (E ranks over T / ETP tensor ranks) is simulated as that many groups
    // along the mesh's E dimension; those with members on one node share the group's bytes
    // through its card (all of them where the tensor ranks share a node, one where each is on
    // another node).
    const double share_of_group = 1.0 / static_cast<double>(fold_per_node_);
    auto mesh_share = [&](CollectiveCost c) {
      c.nic_bytes_per_node *= share_of_group;
      return c;
    };
    // As measured inside the whole micro-batch with the experts over E ranks, where the profile
    // has it (OpCosts::expert_exchange_forward_s): each sync point its share, the waits for the
    // other ranks included, no after-compute extra on top.
    const bool backward = kind == OpKind::kDispatchBackward || kind == OpKind::kCombineBackward;
    if (const double measured = backward ? o_.expert_exchange_backward_s : o_.expert_exchange_forward_s; measured > 0) {
      if (kind == OpKind::kDispatch || kind == OpKind::kDispatchRecompute)
        collective_round(after, MeshDim::kExpert, OpKind::kDispatchCounts, TraceStream::kExpertComm, layer, mb,
                         CollectiveCost{0, measured, 0}, static_cast<double>(p_.expert_parallel_degree * c_.model.num_experts) * 8,
                         false, true);
      collective_round(after, MeshDim::kExpert, kind, TraceStream::kExpertComm, layer, mb, CollectiveCost{0, measured, 0},
                       o_.dispatch_send_bytes, false, true);
      for (size_t r = 0; r < state.size(); ++r) state[r].last = after[r];
      return;
    }
    // (DeepEP's kernels count the tokens for each rank inside the dispatch.)
    if (c_.moe.dispatcher == Dispatcher::kAllToAll && (kind == OpKind::kDispatch || kind == OpKind::kDispatchRecompute)) {
      const double counts = static_cast<double>(p_.expert_parallel_degree * c_.model.num_experts) * 8;  // int64
      collective_round(after, MeshDim::kExpert, OpKind::kDispatchCounts, TraceStream::kExpertComm, layer, mb,
                       mesh_share(cost_.all_gather_cost(counts, shapes_.exchange)), counts, false);
    }
    const CollectiveCost whole_cost = token_exchange_cost(cost_, c_, o_.dispatch_send_bytes, shapes_.exchange);
    CollectiveCost cost = mesh_share(whole_cost);
    const double whole = cost_.seconds(whole_cost, shapes_.exchange);
    if (c_.moe.overlap_exchange) {
      // Beside another micro-batch's compute (merged 1F1B): only what the exchange takes beyond
      // it holds the chain, and only that share of its bytes is left for the card.
      const double cover = kind == OpKind::kDispatch          ? cover_.dispatch
                           : kind == OpKind::kCombine         ? cover_.combine
                           : kind == OpKind::kCombineBackward ? cover_.combine_backward
                           : kind == OpKind::kDispatchBackward ? cover_.dispatch_backward
                                                               : 0.0;
      const double share = whole > 0 ? std::max(0.0, whole - cover) / whole : 1.0;
      cost = {cost.latency_s * share, cost.intra_s * share, cost.nic_bytes_per_node * share};
    } else if (const double beside = kind == OpKind::kDispatch || kind == OpKind::kDispatchRecompute ? shared_.dispatch
                                     : kind == OpKind::kCombine || kind == OpKind::kCombineRecompute  ? shared_.combine
                                                                                                      : 0.0;
               beside > 0 && whole > 0) {
      // The shared experts' forward runs beside it on their own stream: the chain waits only for
      // what the exchange takes beyond them, priced as the merged 1F1B's exposed share is.
      const double share = std::max(0.0, whole - beside) / whole;
      cost = {cost.latency_s * share, cost.intra_s * share, cost.nic_bytes_per_node * share};
    }
    collective_round(after, MeshDim::kExpert, kind, TraceStream::kExpertComm, layer, mb, cost, o_.dispatch_send_bytes,
                     false);
    for (size_t r = 0; r < state.size(); ++r) state[r].last = after[r];
  }

  // What ends a tensor-parallel region, on the compute chain: the next op needs its result.
  // As measured inside the split's whole micro-batch where the profile has it
  // (OpCosts::tensor_region_forward_s), else CostModel::tensor_region_cost.
  void tensor(std::vector<RankState>& state, OpKind kind, int layer, int64_t mb, double bytes) {
    if (p_.tensor_parallel_degree <= 1 || bytes <= 0) return;
    const double measured = kind == OpKind::kTensorBackward ? o_.tensor_region_backward_s : o_.tensor_region_forward_s;
    const CollectiveCost cost = measured > 0 ? CollectiveCost{0, measured, 0}
                                             : cost_.tensor_region_cost(bytes, shapes_.tensor, p_.sequence_parallel);
    std::vector<OpId> after(state.size());
    for (size_t r = 0; r < state.size(); ++r) after[r] = state[r].last;
    collective_round(after, MeshDim::kTensor, kind, TraceStream::kExpertComm, layer, mb, cost, bytes, true, measured > 0);
    for (size_t r = 0; r < state.size(); ++r) state[r].last = after[r];
  }

  // Context parallelism: what a block's key-value exchange leaves exposed after its attention
  // (context_exchange_cost), on the compute chain.
  void context(std::vector<RankState>& state, OpKind kind, int layer, int64_t mb) {
    if (p_.context_parallel_degree <= 1) return;
    const double exposed = kind == OpKind::kContextBackward ? context_.backward_s : context_.forward_s;
    std::vector<OpId> after(state.size());
    for (size_t r = 0; r < state.size(); ++r) after[r] = state[r].last;
    collective_round(after, MeshDim::kContext, kind, TraceStream::kExpertComm, layer, mb, CollectiveCost{0, exposed, 0},
                     o_.context_kv_bytes, true);
    for (size_t r = 0; r < state.size(); ++r) state[r].last = after[r];
  }

  // The tail of the latest compute op (a weight gradient) as its own op beside what follows
  // on the chain: the chain's next collective starts without it, the next compute op waits
  // for it (the compute stream runs one op at a time).
  void beside(std::vector<RankState>& state, OpKind kind, int layer, int64_t mb, double seconds) {
    if (seconds <= 0) return;
    for (size_t r = 0; r < state.size(); ++r) {
      const OpId id = graph_.add_op(compute(r, kind, layer, mb, seconds, 0));
      graph_.depend(id, state[r].last);
    }
  }

  void chain(std::vector<RankState>& state, size_t r, const Op& op) {
    const OpId id = graph_.add_op(op);
    graph_.depend(id, state[r].last);
    state[r].last = id;
  }

  // Block l's feed-forward part on rank r: the experts at the rank's load, or a dense block's
  // feed-forward layer.
  double ffn_seconds(size_t r, int l) const { return moe_block(l) ? moe_by_rank_[r] : o_.dense_forward_s; }
  double ffn_flops(int l) const { return moe_block(l) ? o_.moe_flops : o_.dense_flops; }
  double ffn_tensor_bytes(int l) const { return moe_block(l) ? o_.tensor_moe_bytes : o_.tensor_dense_bytes; }

  // Block l's parameters for forward or backward: an MoE block's dense part and its experts,
  // or a dense block whole.
  void gather_block(std::vector<OpId>& gathered, OpKind kind, int l, int16_t mb) {
    const double measured = kind == OpKind::kGatherForward ? o_.shard_forward_s : o_.shard_backward_s;
    if (!moe_block(l)) {
      gather(gathered, kind, l, mb, o_.dense_block_unit_bytes, true, measured);
      return;
    }
    gather(gathered, kind, l, mb, o_.dense_unit_bytes, true, measured / 2);
    gather(gathered, kind, l, mb, o_.expert_unit_bytes, false, measured / 2);
  }

  // Forward of one block (attention, then the MoE sub-block with its token exchange), the
  // gather of its parameters and the offload of what it keeps.
  void forward_layer(std::vector<RankState>& state, int16_t mb, int l) {
    const size_t n = state.size();
    const bool sharded = p_.shards_states();
    const bool moe = moe_block(l);
    const bool experts = moe && p_.expert_parallel_degree > 1;
    std::vector<OpId> gathered(n, kNoOp);
    if (sharded) {
      // Two buffers: the block in use and the one prefetched; a gather waits for the block
      // two back to be freed. A measured gather (OpCosts::shard_measured) holds what the
      // prefetch took from the compute too: it runs on the chain, after the block before.
      for (size_t r = 0; r < n; ++r)
        gathered[r] = o_.shard_measured ? state[r].last
                      : l >= 2          ? state[r].fwd_done[static_cast<size_t>(l - 2)]
                                        : kNoOp;
      if (l == 0) gather(gathered, OpKind::kGatherForward, -1, mb, o_.embed_unit_bytes, true);
      gather_block(gathered, OpKind::kGatherForward, l, mb);
    }
    for (size_t r = 0; r < n; ++r) {
      chain(state, r, compute(r, OpKind::kAttentionForward, l, mb, o_.attention_forward_s, o_.attention_flops));
      graph_.depend(state[r].last, gathered[r]);
    }
    context(state, OpKind::kContextForward, l, mb);
    tensor(state, OpKind::kTensorForward, l, mb, o_.tensor_bytes);
    if (experts) exchange(state, OpKind::kDispatch, l, mb);
    for (size_t r = 0; r < n; ++r)
      chain(state, r, compute(r, OpKind::kExpertForward, l, mb, ffn_seconds(r, l), ffn_flops(l)));
    tensor(state, OpKind::kTensorForward, l, mb, ffn_tensor_bytes(l));
    if (experts) exchange(state, OpKind::kCombine, l, mb);
    for (size_t r = 0; r < n; ++r) {
      state[r].layer_out = state[r].last;
      state[r].fwd_done[static_cast<size_t>(l)] = state[r].last;
      if (p_.activation_offloading) {
        const OpId id = graph_.add_op(copy(r, OpKind::kOffload, l, mb));
        graph_.depend(id, state[r].last);
        state[r].offloaded[static_cast<size_t>(l)] = id;
      }
    }
  }

  void backward_layer(std::vector<RankState>& state, int16_t mb, int l) {
    const size_t n = state.size();
    const bool sharded = p_.shards_states();
    const bool moe = moe_block(l);
    const bool experts = moe && p_.expert_parallel_degree > 1;
    const auto at = static_cast<size_t>(l);
    std::vector<OpId> gathered(n, kNoOp);
    if (sharded) {
      for (size_t r = 0; r < n; ++r)
        gathered[r] = o_.shard_measured ? state[r].last : l + 2 < layers_ ? state[r].bwd_done[at + 2] : kNoOp;
      gather_block(gathered, OpKind::kGatherBackward, l, mb);
    }
    std::vector<OpId> reloaded(n, kNoOp);
    if (p_.activation_offloading) {
      // Prefetched `horizon` blocks ahead: the reload of block l may start once the backward
      // of block l + horizon + 1 has freed its place.
      const int free_after = l + static_cast<int>(p_.activation_loading_horizon) + 1;
      for (size_t r = 0; r < n; ++r) {
        reloaded[r] = graph_.add_op(copy(r, OpKind::kReload, l, mb));
        graph_.depend(reloaded[r], state[r].offloaded[at]);
        if (free_after < layers_) graph_.depend(reloaded[r], state[r].bwd_done[static_cast<size_t>(free_after)]);
      }
    }
    // The block's first op, whichever it is, waits for its parameters and its activations.
    bool gate_pending = true;
    auto gate_first = [&] {
      if (!gate_pending) return;
      for (size_t r = 0; r < n; ++r) {
        graph_.depend(state[r].last, gathered[r]);
        graph_.depend(state[r].last, reloaded[r]);
      }
      gate_pending = false;
    };
    if (p_.activation_checkpointing == Checkpointing::kFull) {
      for (size_t r = 0; r < n; ++r)
        chain(state, r,
              compute(r, OpKind::kAttentionRecompute, l, mb,
                      std::max(0.0, o_.attention_forward_s + o_.recompute_beyond_forward_s), o_.attention_flops));
      gate_first();
      context(state, OpKind::kContextForward, l, mb);
      tensor(state, OpKind::kTensorRecompute, l, mb, o_.tensor_bytes);
    }
    if (recomputes_moe(p_.activation_checkpointing)) {
      if (experts) {
        exchange(state, OpKind::kDispatchRecompute, l, mb);
        gate_first();
      }
      for (size_t r = 0; r < n; ++r)
        chain(state, r, compute(r, OpKind::kExpertRecompute, l, mb, ffn_seconds(r, l), ffn_flops(l)));
      gate_first();
      tensor(state, OpKind::kTensorRecompute, l, mb, ffn_tensor_bytes(l));
      if (experts) exchange(state, OpKind::kCombineRecompute, l, mb);
    }
    if (experts) {
      exchange(state, OpKind::kCombineBackward, l, mb);
      gate_first();
    }
    const double moe_beside = moe ? std::min(o_.tensor_moe_overlap_s, o_.moe_backward_busiest_s)
                                  : std::min(o_.tensor_dense_overlap_s, o_.dense_backward_s);
    for (size_t r = 0; r < n; ++r) {
      const double backward = moe ? moe_backward_by_rank_[r] : o_.dense_backward_s;
      chain(state, r, compute(r, OpKind::kExpertBackward, l, mb, backward - moe_beside, 2.0 * ffn_flops(l)));
    }
    gate_first();
    beside(state, OpKind::kExpertBackward, l, mb, moe_beside);
    if (sharded && moe) reduce_scatter(state, l, mb, o_.expert_unit_bytes, false);  // the experts' gradients are complete
    tensor(state, OpKind::kTensorBackward, l, mb, ffn_tensor_bytes(l));
    if (experts) exchange(state, OpKind::kDispatchBackward, l, mb);
    if (p_.activation_checkpointing == Checkpointing::kAttentionCore) {
      for (size_t r = 0; r < n; ++r)
        chain(state, r, compute(r, OpKind::kAttentionRecompute, l, mb, o_.core_forward_s, o_.core_flops));
      context(state, OpKind::kContextForward, l, mb);
    }
    if (p_.activation_checkpointing == Checkpointing::kLatentUpProjections)
      for (size_t r = 0; r < n; ++r)
        chain(state, r, compute(r, OpKind::kAttentionRecompute, l, mb, o_.latent_up_forward_s, o_.latent_up_flops));
    const double attention_beside = std::min(o_.tensor_overlap_s, o_.attention_backward_s);
    for (size_t r = 0; r < n; ++r)
      chain(state, r,
            compute(r, OpKind::kAttentionBackward, l, mb, o_.attention_backward_s - attention_beside,
                    2.0 * o_.attention_flops));
    beside(state, OpKind::kAttentionBackward, l, mb, attention_beside);
    context(state, OpKind::kContextBackward, l, mb);
    tensor(state, OpKind::kTensorBackward, l, mb, o_.tensor_bytes);
    for (size_t r = 0; r < n; ++r) state[r].bwd_done[at] = state[r].last;
    if (sharded) {
      reduce_scatter(state, l, mb, moe ? o_.dense_unit_bytes : o_.dense_block_unit_bytes, true);
    } else {
      for (size_t r = 0; r < n; ++r) state[r].last_grad = state[r].last;
    }
  }

  const RunConfig& c_;
  const ParallelConfig& p_;
  const Layout& layout_;
  CostModel cost_;
  OpCosts o_;
  ExchangeCover cover_;  // under moe.overlap_exchange
  SharedExpertCover shared_;  // under moe.overlap_shared_expert
  int64_t fold_per_node_;  // a folded expert group's mesh-E groups with members on one node
  LayoutShapes shapes_;
  ContextExchangeCost context_;  // under context parallelism, per block
  StepGraph graph_;
  int64_t micro_batches_;
  int layers_;
  std::vector<double> moe_by_rank_;  // MoE forward seconds of each simulated rank
  std::vector<double> moe_backward_by_rank_;
  bool overlap_sync_ = true;     // gradient syncs overlap the last micro-batch's backward
  // Gradient bytes over the compute dtype's: 2 where mixed precision reduces in fp32.
  double grad_scale_ = 1.0;
  std::vector<OpId> synced_;     // each rank's latest gradient sync
};

// When the last op of each micro-batch ended: its compute, its copies and its gradient
// reduce-scatters, which may trail behind when a network card is the bottleneck.
std::vector<SimTime> micro_batch_ends(const StepGraph& g, const GraphTimes& t, int64_t micro_batches) {
  std::vector<SimTime> ends(static_cast<size_t>(micro_batches), SimTime(0));
  for (size_t i = 0; i < g.ops().size(); ++i) {
    const int16_t mb = g.ops()[i].micro_batch;
    if (mb >= 0) ends[static_cast<size_t>(mb)] = std::max(ends[static_cast<size_t>(mb)], t.end[i]);
  }
  return ends;
}

// The bytes node 0's network card carries for micro-batch `mb`'s collectives.
double card_bytes_of_micro_batch(const StepGraph& g, int64_t mb) {
  double card_bytes = 0;
  std::vector<bool> counted(g.collectives().size(), false);
  for (const Op& op : g.ops()) {
    if (op.micro_batch != mb || op.collective < 0 || counted[static_cast<size_t>(op.collective)]) continue;
    counted[static_cast<size_t>(op.collective)] = true;
    const Collective& col = g.collectives()[static_cast<size_t>(op.collective)];
    if (col.node_count > 0 && g.collective_nodes()[static_cast<size_t>(col.first_node)] == 0)
      card_bytes += col.nic_bytes_per_node;
  }
  return card_bytes;
}

// The work micro-batch `mb` gives its busiest resource: the sum of its op times on one
// stream of one rank (a collective counted from its start, not from a member's arrival), or
// the bytes it pushes through node 0's card (card_bytes_of_micro_batch) over the card's bandwidth.
SimTime busiest_resource_work(const StepGraph& g, const GraphTimes& t, int64_t mb, double card_bytes,
                              double card_bytes_per_s) {
  std::vector<SimTime> stream(static_cast<size_t>(g.ranks()) * kTraceStreamCount, SimTime(0));
  for (size_t i = 0; i < g.ops().size(); ++i) {
    const Op& op = g.ops()[i];
    if (op.micro_batch != mb) continue;
    const SimTime begin = op.collective >= 0 ? t.collective_start[static_cast<size_t>(op.collective)] : t.start[i];
    const TraceStream on = g.serial_streams() ? TraceStream::kCompute : op.stream;
    stream[static_cast<size_t>(op.rank) * kTraceStreamCount + static_cast<size_t>(on)] += t.end[i] - begin;
  }
  SimTime most = *std::max_element(stream.begin(), stream.end());
  return std::max(most, SimTime(static_cast<int64_t>(std::ceil(card_bytes / card_bytes_per_s * 1e9))));
}

// What a repeated micro-batch adds to the step's collectives but the period leaves out: a
// micro-batch with no collective on a rank (pure data parallelism between its gradient
// all-reduces) hands its compute on to the gradient all-reduce after the simulated
// micro-batches. That all-reduce then follows the whole step's compute; each repeated
// micro-batch adds its share of what that costs. A micro-batch with collectives pays inside
// the period.
SimTime unsynced_after_compute(const StepGraph& g, const GraphTimes& t, int64_t micro_batches) {
  const CurvePoints& curve = g.after_compute().all_reduce;
  if (curve.empty()) return SimTime(0);
  std::vector<SimTime> compute(static_cast<size_t>(g.ranks()), SimTime(0));
  std::vector<bool> synced(static_cast<size_t>(g.ranks()), false);
  for (size_t i = 0; i < g.ops().size(); ++i) {
    const Op& op = g.ops()[i];
    if (op.micro_batch != 1) continue;
    if (op.collective >= 0) synced[static_cast<size_t>(op.rank)] = true;
    else if (op.stream == TraceStream::kCompute) compute[static_cast<size_t>(op.rank)] += t.end[i] - t.start[i];
  }
  double most = 0;
  for (size_t r = 0; r < compute.size(); ++r)
    if (!synced[r]) most = std::max(most, to_seconds(compute[r]));
  const double whole = most * static_cast<double>(micro_batches);
  return to_sim_time(whole > 0 ? after_compute_seconds(curve, whole) / whole * most : 0.0);
}

// Seconds in [from, to) during which rank `rank`'s compute stream and at least one of its
// communication or copy streams are both busy (a collective counted from its start, when every
// member arrived).
double overlapped_seconds(const StepGraph& g, const GraphTimes& t, int32_t rank, SimTime from, SimTime to) {
  std::vector<std::pair<SimTime, SimTime>> compute, comm;
  for (size_t i = 0; i < g.ops().size(); ++i) {
    const Op& op = g.ops()[i];
    if (op.rank != rank) continue;
    if (op.stream == TraceStream::kCompute) {
      compute.emplace_back(t.start[i], t.end[i]);
    } else {
      const SimTime begin = op.collective >= 0 ? t.collective_start[static_cast<size_t>(op.collective)] : t.start[i];
      comm.emplace_back(begin, t.end[i]);
    }
  }
  // The union of the communication intervals, then its intersection with each compute op.
  std::sort(comm.begin(), comm.end());
  std::vector<std::pair<SimTime, SimTime>> merged;
  for (const auto& iv : comm) {
    if (!merged.empty() && iv.first <= merged.back().second) merged.back().second = std::max(merged.back().second, iv.second);
    else merged.push_back(iv);
  }
  SimTime total{0};
  for (auto [b, e] : compute) {
    b = std::max(b, from);
    e = std::min(e, to);
    if (e <= b) continue;
    auto it = std::upper_bound(merged.begin(), merged.end(), std::make_pair(b, SimTime::max()));
    if (it != merged.begin()) --it;
    for (; it != merged.end() && it->first < e; ++it) {
      const SimTime lo = std::max(b, it->first), hi = std::min(e, it->second);
      if (hi > lo) total += hi - lo;
    }
  }
  return to_seconds(total);
}

// One pipeline stage's step (the whole step without pipeline parallelism): every micro-batch
// through the stage's blocks and the head, the gradient sync and the update.
StepSimulation simulate_stage(const RunConfig& c, const StepSimOptions& options) {
  const ParallelConfig& p = c.parallel;
  StepSimulation sim;
  const Layout layout(c, options.all_ranks);
  sim.ranks = layout.ranks();
  sim.micro_batches = options.all_micro_batches ? p.gradient_accumulation_steps
                                                : std::min<int64_t>(kSimulatedMicroBatches, p.gradient_accumulation_steps);
  sim.graph = Builder(c, layout, sim.micro_batches).build();
  sim.checkpointing = p.activation_checkpointing;
  if (!op_times_apply(c)) {
    sim.kernels = micro_batch_kernels(c);
    if (c.model.has_dense_layers()) sim.dense_kernels = dense_block_kernels(c);
  }
  for (int64_t l = 0; l < c.model.blocks(); ++l) sim.dense_blocks.push_back(!c.model.moe_layer(l));
  sim.block_activation_bytes = op_costs(c).offload_bytes;
  sim.graph.set_serial_streams(!c.cluster.comm_overlaps_compute);
  sim.graph.set_after_compute(c.cluster.after_compute);
  sim.times = run_graph(sim.graph, c.cluster.inter_node_bandwidth_bytes_per_s);
  if (sim.times.finished != sim.graph.ops().size())
    throw std::logic_error("step simulation deadlocked: " +
                           std::to_string(sim.graph.ops().size() - sim.times.finished) + " ops never ran");

  // Micro-batches between the second and the last repeat the second. Each adds a period: the
  // time from the end of the first to the end of the second (the last is shorter: no next
  // micro-batch competes with its reduce-scatters), but at least the work one micro-batch
  // gives the busiest resource (a stream, or node 0's card), which may still be filling its
  // backlog.
  const int64_t repeats = p.gradient_accumulation_steps - sim.micro_batches;
  SimTime period{0};
  const double card_bytes = sim.micro_batches >= 2 ? card_bytes_of_micro_batch(sim.graph, 1) : 0.0;
  const std::vector<SimTime> ends = micro_batch_ends(sim.graph, sim.times, sim.micro_batches);
  if (sim.micro_batches >= 2) {
    period = ends[1] - ends[0];
    period = std::max(period, busiest_resource_work(sim.graph, sim.times, 1, card_bytes,
                                                     c.cluster.inter_node_bandwidth_bytes_per_s));
    if (repeats > 0) period += unsynced_after_compute(sim.graph, sim.times, p.gradient_accumulation_steps);
  }
  sim.micro_batch_s = to_seconds(sim.micro_batches >= 2 ? period : ends[0]);
  double step = to_seconds(sim.times.makespan + (repeats > 0 ? period * repeats : SimTime(0)));
  const double scale = static_cast<double>(p.gradient_accumulation_steps) / static_cast<double>(sim.micro_batches);

  // Busy time per kind on the busiest rank's compute stream.
  StepEstimate& est = sim.estimate;
  std::vector<double> compute(sim.ranks.size(), 0), recompute(sim.ranks.size(), 0);
  for (size_t i = 0; i < sim.graph.ops().size(); ++i) {
    const Op& op = sim.graph.ops()[i];
    if (op.stream != TraceStream::kCompute) continue;
    const double d = to_seconds(sim.times.end[i] - sim.times.start[i]);
    if (op.kind == OpKind::kAttentionRecompute || op.kind == OpKind::kExpertRecompute)
      recompute[static_cast<size_t>(op.rank)] += d;
    else if (op.kind != OpKind::kOptimizer)
      compute[static_cast<size_t>(op.rank)] += d;
  }
  size_t busiest = 0;
  for (size_t r = 1; r < compute.size(); ++r)
    if (compute[r] + recompute[r] > compute[busiest] + recompute[busiest]) busiest = r;
  const OpCosts o = op_costs(c);
  // Compute that runs beside communication shares the GPU's SMs and memory with it and slows
  // by the profile's overlap_slowdown for that time: the step is longer by as much.
  // The repeated micro-batches overlap as the second one did (its window is the period).
  if (!sim.graph.serial_streams() && c.cluster.overlap_slowdown > 0) {
    const auto rank = static_cast<int32_t>(busiest);
    double overlapped = overlapped_seconds(sim.graph, sim.times, rank, SimTime(0), SimTime::max());
    double in_period = 0;
    if (sim.micro_batches >= 2) {
      in_period = overlapped_seconds(sim.graph, sim.times, rank, ends[0], ends[1]);
      if (repeats > 0) overlapped += in_period * static_cast<double>(repeats);
    }
    // Under moe.overlap_exchange the covered part of each exchange runs beside another
    // micro-batch's compute (ExchangeCover::covered), off the simulated chain.
    // Under moe.overlap_shared_expert the shared experts' forward runs beside each forward
    // exchange, its part of the exchange off the chain likewise.
    const SharedExpertCover shared = shared_expert_cover(c, o);
    if ((c.moe.overlap_exchange || shared.dispatch + shared.combine > 0) && p.expert_parallel_degree > 1) {
      const CostModel cost(c.cluster);
      const LayoutShapes shapes = layout_shapes(c.cluster, p);
      const double exchange = cost.seconds(token_exchange_cost(cost, c, o.dispatch_send_bytes, shapes.exchange), shapes.exchange);
      const double per_block = c.moe.overlap_exchange ? exchange_cover(o).covered(exchange)
                                                      : shared.hidden(exchange, recomputes_moe(p.activation_checkpointing));
      const double per_micro_batch = static_cast<double>(c.model.moe_blocks()) * per_block;
      overlapped += per_micro_batch * static_cast<double>(p.gradient_accumulation_steps);
      in_period += per_micro_batch;
    }
    est.contention_s = c.cluster.overlap_slowdown * overlapped;
    step += est.contention_s;
    sim.micro_batch_s += c.cluster.overlap_slowdown * (sim.micro_batches >= 2 ? in_period : overlapped);
  }
  est.step_time_s = step;
  est.compute_s = compute[busiest] * scale;
  est.recompute_s = recompute[busiest] * scale;
  est.optimizer_s = to_seconds(to_sim_time(o.optimizer_s));
  est.exposed_comm_s =
      std::max(0.0, step - est.compute_s - est.recompute_s - est.optimizer_s - est.contention_s);
  // The card's simulated busy time, and for each micro-batch not simulated the card time of a
  // repeated one (the step's gradient sync and update happen once, not per micro-batch).
  sim.nic_busy_s = sim.times.nic_busy.empty() ? 0 : to_seconds(sim.times.nic_busy[0]);
  if (repeats > 0 && sim.micro_batches >= 2)
    sim.nic_busy_s += static_cast<double>(repeats) * card_bytes / c.cluster.inter_node_bandwidth_bytes_per_s;
  split_compute(o, est);
  fill_rates(c, est);
  return sim;
}

}  // namespace

StepSimulation simulate_step(const RunConfig& c, const StepSimOptions& options) {
  const ParallelConfig& p = c.parallel;
  if (p.pipeline_parallel_degree <= 1) return simulate_stage(c, options);
  // A pipeline: one stage's step (its blocks, with the head, every micro-batch, the gradient
  // sync and the update), then the 1F1B schedule of the P stages around it. The stages are
  // equal but for the head, which only the last runs; the first stage's embedding lookup is
  // free. The step is the schedule's makespan plus what the stage's step spends after its
  // micro-batches (gradient sync, update).
  const ModelSpec blocks = stage_model(c);
  const RunConfig stage{blocks, c.cluster, c.parallel, c.moe, c.training, c.target};
  StepSimulation sim = simulate_stage(stage, options);
  const OpCosts o = op_costs(stage);
  const StageCompute work = stage_compute(o, p, {blocks.blocks(), blocks.moe_blocks()});
  const double whole = work.total();
  const double forward_share = whole > 0 ? work.forward / whole : 1.0 / 3.0;
  // The simulated stage is the last; the others take its time without the head in the ratio
  // of their blocks' compute to its (their blocks, with dense blocks among MoE blocks apart).
  const double last = sim.micro_batch_s;
  const double per_weight = std::max(0.0, last - o.head_s) / (whole > 0 ? whole : 1.0);
  std::vector<PipelineStage> stages;
  for (int64_t i = 0; i < p.pipeline_parallel_degree; ++i) {
    const double stage_s = i + 1 == p.pipeline_parallel_degree
                               ? last
                               : per_weight * stage_weight(o, p, stage_block_counts(c.model, p, i));
    stages.push_back({stage_s * forward_share, stage_s * (1 - forward_share)});
  }
  const CostModel cost(c.cluster);
  const GroupShape pipeline_group = group_shape(c.cluster, p, MeshDim::kPipeline);
  const double send = cost.send_seconds(o.stage_send_bytes, pipeline_group);
  // Stages on other nodes pass activations forward and gradients back through each node's card:
  // every rank of a node sends one of each per micro-batch and chunk.
  if (pipeline_group.crosses_nodes()) {
    const double node_ranks = static_cast<double>(std::min(p.world_size, c.cluster.gpus_per_node));
    const double out_bytes = 2.0 * static_cast<double>(p.gradient_accumulation_steps) *
                             static_cast<double>(std::max<int64_t>(1, p.virtual_pipeline_degree)) * node_ranks *
                             o.stage_send_bytes;
    sim.nic_busy_s += out_bytes / c.cluster.inter_node_bandwidth_bytes_per_s;
  }
  const double pipeline_s = pipeline_step_seconds(stages, p.gradient_accumulation_steps, send,
                                                  std::max<int64_t>(1, p.virtual_pipeline_degree));
  const double m = static_cast<double>(p.gradient_accumulation_steps);
  const double after_micro_batches = std::max(0.0, sim.estimate.step_time_s - m * last);
  StepEstimate& est = sim.estimate;
  est.step_time_s = pipeline_s + after_micro_batches;
  est.pipeline_bubble_s = std::max(0.0, pipeline_s - m * last);
  est.exposed_comm_s =
      std::max(0.0, est.step_time_s - est.compute_s - est.recompute_s - est.optimizer_s - est.contention_s);
  fill_rates(c, est);
  return sim;
}

namespace {

// The kernels a compute op runs (a dense block's feed-forward layer its own), or nullptr for
// an op drawn whole.
const KernelList* kernels_of(const StepSimulation& sim, const Op& op) {
  const OpKind kind = op.kind;
  const bool dense = op.layer >= 0 && static_cast<size_t>(op.layer) < sim.dense_blocks.size() &&
                     sim.dense_blocks[static_cast<size_t>(op.layer)];
  const MicroBatchKernels& k = dense && kind != OpKind::kAttentionForward && kind != OpKind::kAttentionBackward &&
                                       kind != OpKind::kAttentionRecompute
                                   ? sim.dense_kernels
                                   : sim.kernels;
  switch (kind) {
    case OpKind::kAttentionForward: return &k.attention_forward;
    case OpKind::kAttentionBackward: return &k.attention_backward;
    case OpKind::kExpertForward:
    case OpKind::kExpertRecompute: return &k.moe_forward;
    case OpKind::kExpertBackward: return &k.moe_backward;
    case OpKind::kAttentionRecompute:
      return sim.checkpointing == Checkpointing::kAttentionCore        ? &k.core_forward
             : sim.checkpointing == Checkpointing::kLatentUpProjections ? &k.latent_up_forward
                                                                        : &k.attention_forward;
    default: return nullptr;
  }
}

}  // namespace

Trace step_trace(const StepSimulation& sim) {
  Trace whole = to_trace(sim.graph, sim.times);
  Trace t = whole;
  t.events.clear();
  t.events.reserve(whole.events.size() * 8);
  for (size_t i = 0; i < whole.events.size(); ++i) {
    TraceEvent& e = whole.events[i];
    e.rank = sim.ranks[static_cast<size_t>(e.rank)];
    const Op& op = sim.graph.ops()[i];
    // The head op holds the head's forward kernels, then its backward ones.
    std::vector<std::pair<const KernelList*, std::string_view>> parts;
    if (op.stream == TraceStream::kCompute && op.kind == OpKind::kHeadForwardBackward && sim.kernels.head_forward.size() > 0) {
      parts = {{&sim.kernels.head_forward, "head_fwd"}, {&sim.kernels.head_backward, "head_bwd"}};
    } else if (const KernelList* l = op.stream == TraceStream::kCompute ? kernels_of(sim, op) : nullptr;
               l != nullptr && l->size() > 0 && e.duration_ns > 0) {
      parts = {{l, op_kind_name(op.kind)}};
    }
    double total = 0;
    for (const auto& [l, name] : parts) total += l->seconds();
    if (parts.empty() || total <= 0) {
      t.events.push_back(std::move(e));
      continue;
    }
    // Kernels in proportion to their times, whole nanoseconds, the last one ending with the op.
    const size_t dot = e.name.rfind('.');
    const std::string prefix = dot == std::string::npos ? std::string() : e.name.substr(0, dot + 1);
    int64_t at = e.start_ns;
    double done = 0;
    for (const auto& [l, name] : parts)
      for (const Kernel& k : l->kernels()) {
        done += k.seconds;
        const int64_t end = e.start_ns + static_cast<int64_t>(std::llround(static_cast<double>(e.duration_ns) * done / total));
        if (end <= at) continue;
        TraceEvent kernel = e;
        kernel.name = prefix + std::string(k.name) + "." + std::string(name);
        kernel.start_ns = at;
        kernel.duration_ns = end - at;
        kernel.flops = k.flops;
        kernel.bytes = 0;
        t.events.push_back(std::move(kernel));
        at = end;
      }
  }
  return t;
}

Trace step_trace(const StepSimulation& sim, double resident_bytes) {
  Trace t = step_trace(sim);
  const double a = sim.block_activation_bytes;
  // Per simulated rank: (time, change in bytes).
  std::vector<std::vector<std::pair<int64_t, double>>> changes(sim.ranks.size());
  const StepGraph& g = sim.graph;
  for (size_t i = 0; i < g.ops().size(); ++i) {
    const Op& op = g.ops()[i];
    if (op.layer < 0 || op.micro_batch < 0) continue;
    auto& c = changes[static_cast<size_t>(op.rank)];
    const int64_t start = sim.times.start[i].count(), end = sim.times.end[i].count();
    switch (op.kind) {
      case OpKind::kExpertForward: c.emplace_back(end, a); break;
      case OpKind::kOffload: c.emplace_back(end, -a); break;
      case OpKind::kReload: c.emplace_back(start, a); break;
      case OpKind::kAttentionBackward: c.emplace_back(end, -a); break;
      default: break;
    }
  }
  for (size_t r = 0; r < changes.size(); ++r) {
    auto& c = changes[r];
    std::stable_sort(c.begin(), c.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    const int64_t rank = sim.ranks[r];
    double bytes = resident_bytes;
    t.memory.push_back({rank, 0, bytes});
    for (size_t i = 0; i < c.size(); ++i) {
      bytes += c[i].second;
      if (i + 1 < c.size() && c[i + 1].first == c[i].first) continue;  // one sample per moment
      if (t.memory.back().time_ns == c[i].first) t.memory.back().bytes = std::max(0.0, bytes);
      else t.memory.push_back({rank, c[i].first, std::max(0.0, bytes)});
    }
  }
  return t;
}

std::vector<std::pair<std::string, double>> phase_seconds(const StepSimulation& sim, int32_t rank) {
  const StepGraph& g = sim.graph;
  const GraphTimes& t = sim.times;
  const auto mbs = static_cast<size_t>(sim.micro_batches);
  std::vector<SimTime> first(mbs, SimTime::max()), last(mbs, SimTime(0)), loss(mbs, SimTime(0));
  SimTime update_begin = SimTime::max(), update_end(0);
  std::map<std::string, double> inside;
  for (size_t i = 0; i < g.ops().size(); ++i) {
    const Op& op = g.ops()[i];
    if (op.rank != rank) continue;
    const std::string category(op_category(op.kind));
    if (category != "compute") inside[category] += to_seconds(t.end[i] - t.start[i]);
    if (op.micro_batch < 0) {
      update_begin = std::min(update_begin, t.start[i]);
      update_end = std::max(update_end, t.end[i]);
      continue;
    }
    const auto mb = static_cast<size_t>(op.micro_batch);
    first[mb] = std::min(first[mb], t.start[i]);
    last[mb] = std::max(last[mb], t.end[i]);
    if (op.kind == OpKind::kHeadForwardBackward) loss[mb] = t.start[i] + (t.end[i] - t.start[i]) / 3;
  }
  double forward = 0, backward = 0;
  for (size_t mb = 0; mb < mbs; ++mb) {
    if (first[mb] == SimTime::max()) continue;
    forward += to_seconds(loss[mb] - first[mb]);
    backward += to_seconds(last[mb] - loss[mb]);
  }
  std::vector<std::pair<std::string, double>> out{{std::string(phase::kForward), forward},
                                                  {std::string(phase::kBackward), backward}};
  out.emplace_back(phase::kOptimizer, update_begin == SimTime::max() ? 0.0 : to_seconds(update_end - update_begin));
  for (std::string_view c : phase::kCollectives) out.emplace_back(c, inside[std::string(c)]);
  out.emplace_back(phase::kCopy, inside[std::string(phase::kCopy)]);
  return out;
}

}  // namespace moeplan::sim
