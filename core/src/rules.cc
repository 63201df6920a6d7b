#include "moeplan/core/rules.h"

#include <algorithm>
#include <array>

namespace moeplan {

namespace {

constexpr std::array<std::string_view, kRuleCount> kRuleNames = {
    "top_k_within_experts",
    "kv_heads_divide_heads",
    "head_dim_even",
    "model_size",
    "moe_layer_pattern",
    "latent_attention_shape",
    "router_groups",
    "block_variants",
    "world_size_fits_cluster",
    "whole_nodes",
    "expert_degree_divides_experts",
    "expert_degree_divides_world",
    "shard_degree_resolved",
    "shard_expert_divides_world",
    "tensor_degree_divides_heads",
    "tensor_degree_divides_intermediate",
    "expert_tensor_folds",
    "expert_spans_context",
    "sequence_parallel_needs_tensor",
    "expert_tensor_needs_sequence_parallel",
    "pipeline_degree_divides_layers",
    "virtual_stages_fit_the_pipeline",
    "groups_share_one_shape",
    "seq_len_within_positions",
    "micro_batch_tokens",
    "global_batch_matches",
    "context_splits_sequence",
    "context_needs_flash_attention",
    "offload_needs_checkpointing",
    "latent_up_needs_latent_attention",
    "horizon_positive",
    "horizon_within_layers",
    "load_imbalance_range",
    "token_shuffle_needs_experts",
    "exchange_overlap_schedule",
    "token_counts_match_experts",
    "deepep_layout",
    "capacity_needs_factor",
    "min_lr_within_lr",
    "warmup_within_steps",
    "fp8_needs_hardware",
};

// Largest model whose counts stay far from int64 overflow in every derived quantity.
constexpr double kMaxParameters = 1e15;
// Tokens of one micro-batch on one rank; keeps activation sizes far from overflow.
constexpr double kMaxMicroBatchTokens = 16777216;

std::string str(int64_t v) { return rule_number(v); }
std::string str(double v) { return rule_number(v); }

// Sinks receive (rule, field, message-maker); the mask sink never calls the maker.
// A framework's rules report through a RuleSink of the same kind (for_target).
struct MaskSink {
  RuleMask mask = 0;
  template <class F>
  void operator()(Rule r, const char*, F&&) { mask |= rule_bit(r); }
  RuleSink for_target(std::span<const std::string_view> names) { return RuleSink(mask, names); }
};
struct MessageSink {
  std::vector<Violation> out;
  template <class F>
  void operator()(Rule r, const char* field, F&& make) {
    out.push_back({r, field, make(), kRuleNames[static_cast<size_t>(r)]});
  }
  RuleSink for_target(std::span<const std::string_view> names) { return RuleSink(out, names); }
};

// Dense blocks among MoE blocks: a pattern that leaves at least one MoE block, the dense
// blocks' width exactly where there are dense blocks, and multi-token prediction blocks (of
// the last block's kind) after an MoE block.
template <class Sink>
void check_moe_layer_pattern(const ModelSpec& m, Sink& sink) {
  const bool patterned = m.first_dense_layers > 0 || m.moe_layer_step > 1 || m.moe_layer_offset > 0;
  if (patterned && m.dense())
    sink(Rule::kMoeLayerPattern, "first_dense_layers", [&] {
      return std::string("and moe_layer_step place dense blocks among MoE blocks; a dense model (num_experts = 1) "
                         "has no MoE blocks");
    });
  else if (m.moe_layer_step < 1 || m.moe_layer_offset < 0 || m.moe_layer_offset >= m.moe_layer_step)
    sink(Rule::kMoeLayerPattern, "moe_layer_offset", [&] {
      return "= " + str(m.moe_layer_offset) + " must lie in [0, moe_layer_step = " + str(m.moe_layer_step) + ")";
    });
  else if (!m.dense() && m.moe_layers() == 0)
    sink(Rule::kMoeLayerPattern, m.first_dense_layers > 0 ? "first_dense_layers" : "moe_layer_step", [&] {
      if (m.first_dense_layers == 0)
        return "= " + str(m.moe_layer_step) + " leaves no MoE block among num_layers = " + str(m.num_layers);
      return "= " + str(m.first_dense_layers) + " with moe_layer_step = " + str(m.moe_layer_step) +
             " leaves no MoE block among num_layers = " + str(m.num_layers);
    });
  else if (m.mtp_layers > 0 && !m.moe_layer(m.num_layers - 1))
    sink(Rule::kMoeLayerPattern, "mtp_layers", [&] {
      return "= " + str(m.mtp_layers) + " after a dense last block: a multi-token prediction block is of the last "
             "block's kind, and only MoE ones are modelled";
    });
  else if (m.has_dense_layers() != (m.dense_intermediate_size > 0))
    sink(Rule::kMoeLayerPattern, "dense_intermediate_size", [&] {
      return m.has_dense_layers() ? std::string("must give the width of the dense blocks' feed-forward layer")
                                  : "= " + str(m.dense_intermediate_size) + " without dense blocks (every block has experts)";
    });
}

// Multi-head latent attention: its widths only with a key-value latent, a rotary part inside a
// head's query and key width, a value width, and a key and value for every head.
template <class Sink>
void check_latent_attention(const ModelSpec& m, Sink& sink) {
  if (!m.mla()) {
    const auto [field, value] = m.q_lora_rank > 0        ? std::pair{"q_lora_rank", m.q_lora_rank}
                                : m.qk_rope_head_dim > 0 ? std::pair{"qk_rope_head_dim", m.qk_rope_head_dim}
                                                         : std::pair{"v_head_dim", m.v_head_dim};
    if (value > 0)
      sink(Rule::kLatentAttentionShape, field, [&, value = value] {
        return "= " + str(value) + " without kv_lora_rank: latent attention's widths need its key-value latent";
      });
    return;
  }
  if (m.qk_rope_head_dim < 2 || m.qk_rope_head_dim % 2 != 0 || m.qk_rope_head_dim >= m.head_dim)
    sink(Rule::kLatentAttentionShape, "qk_rope_head_dim", [&] {
      return "= " + str(m.qk_rope_head_dim) + " must be even, at least 2 and less than head_dim = " + str(m.head_dim) +
             " (a head's query and key: qk_nope_head_dim + qk_rope_head_dim)";
    });
  else if (m.v_head_dim < 1)
    sink(Rule::kLatentAttentionShape, "v_head_dim", [&] {
      return "= " + str(m.v_head_dim) + ": latent attention needs a value width per head";
    });
  else if (m.num_key_value_heads != m.num_attention_heads)
    sink(Rule::kLatentAttentionShape, "num_key_value_heads", [&] {
      return "= " + str(m.num_key_value_heads) + ": latent attention makes a key and a value for every head "
             "(num_attention_heads = " + str(m.num_attention_heads) + ")";
    });
  else if (m.qk_norm || m.qkv_bias)
    sink(Rule::kLatentAttentionShape, m.qk_norm ? "qk_norm" : "qkv_bias", [&] {
      return std::string("= true with latent attention, which norms its latents and has no projection biases");
    });
}

// Group-limited routing: whole groups of experts, no more chosen than there are, and enough
// experts in the chosen groups for the top-k.
template <class Sink>
void check_router_groups(const ModelSpec& m, Sink& sink) {
  const int64_t g = m.router_groups;
  if (g < 1 || m.num_experts % g != 0)
    sink(Rule::kRouterGroups, "router_groups", [&] {
      return "= " + str(g) + " does not divide num_experts = " + str(m.num_experts);
    });
  else if (m.router_group_topk < 1 || m.router_group_topk > g)
    sink(Rule::kRouterGroups, "router_group_topk", [&] {
      return "= " + str(m.router_group_topk) + " must lie in [1, router_groups = " + str(g) + "]";
    });
  else if (g > 1 && m.router_group_topk * (m.num_experts / g) < m.experts_per_token)
    sink(Rule::kRouterGroups, "router_group_topk", [&] {
      return "= " + str(m.router_group_topk) + " groups of " + str(m.num_experts / g) + " experts hold fewer than " +
             "experts_per_token = " + str(m.experts_per_token);
    });
}

// Full-attention blocks among windowed ones need a window, and GPT-OSS's clamped gate a
// gated feed-forward layer.
template <class Sink>
void check_block_variants(const ModelSpec& m, Sink& sink) {
  if (m.full_attention_step > 0 && !m.sliding_window)
    sink(Rule::kBlockVariants, "full_attention_step", [&] {
      return "= " + str(m.full_attention_step) + " without sliding_window: the other blocks need a window";
    });
  else if (m.glu_limit > 0 && m.mlp != Mlp::kSwiGlu)
    sink(Rule::kBlockVariants, "glu_limit", [&] {
      return "= " + str(m.glu_limit) + " with mlp = \"gelu\": the clamped gate is a gated (SwiGLU-shaped) layer";
    });
}

template <class Sink>
void check_model(const ModelSpec& m, Sink& sink) {
  if (m.experts_per_token > m.num_experts)
    sink(Rule::kTopKWithinExperts, "experts_per_token", [&] {
      return "= " + str(m.experts_per_token) + " exceeds num_experts = " + str(m.num_experts);
    });
  if (m.num_key_value_heads <= 0 || m.num_attention_heads % m.num_key_value_heads != 0)
    sink(Rule::kKvHeadsDivideHeads, "num_key_value_heads", [&] {
      return "= " + str(m.num_key_value_heads) + " does not divide num_attention_heads = " +
             str(m.num_attention_heads);
    });
  // (Latent attention rotates its qk_rope_head_dim alone: latent_attention_shape.)
  if (!m.mla() && m.head_dim % 2 != 0)
    sink(Rule::kHeadDimEven, "head_dim", [&] {
      return "= " + str(m.head_dim) + " is odd; rotary embeddings rotate pairs of dimensions";
    });
  check_moe_layer_pattern(m, sink);
  check_latent_attention(m, sink);
  check_router_groups(m, sink);
  check_block_variants(m, sink);
  // Counted in double so that a huge model cannot overflow before it is rejected.
  const double h = static_cast<double>(m.hidden_size);
  const double layers = static_cast<double>(m.num_layers) + static_cast<double>(m.mtp_layers);
  const double params =
      2.0 * static_cast<double>(m.vocab_size) * h +
      layers * (4.0 * h * static_cast<double>(m.num_attention_heads * m.head_dim) +
                static_cast<double>(m.mlp_matrices()) * h *
                    (static_cast<double>(m.num_experts) * static_cast<double>(m.intermediate_size) +
                     static_cast<double>(m.shared_expert_intermediate_size) +
                     static_cast<double>(m.dense_intermediate_size)));
  if (params > kMaxParameters)
    sink(Rule::kModelSize, "num_layers", [&] {
      return "and the other sizes give about " + str(params) + " parameters, over the supported " +
             str(kMaxParameters);
    });
}

// Parallel folding (Megatron-Core): with expert_tensor_parallel_degree below T, the T / ETP
// tensor-parallel ranks of each routed expert's split join its expert group. moeplan prices ETP
// = T and ETP = 1 (every tensor rank folded, the published runs' choice), the fold dividing E,
// and the expert group laid out as Megatron-Core lays it: the mesh's E dimension directly
// outside T, so that a group is E ranks ETP apart.
template <class Sink>
void check_expert_fold(const RunConfig& c, Sink& sink) {
  const ParallelConfig& p = c.parallel;
  const int64_t etp = p.expert_tensor_parallel_degree, tp = p.tensor_parallel_degree, e = p.expert_parallel_degree;
  if (etp == 0 || etp == tp || tp < 1) return;
  const char* field = "parallel.expert_tensor_parallel_degree";
  if (etp != 1)
    sink(Rule::kExpertTensorFolds, field, [&] {
      return "= " + str(etp) + " with tensor_parallel_degree = " + str(tp) +
             ": moeplan splits routed experts over all T ranks or over none (1, every tensor rank folded into the "
             "expert group)";
    });
  else if (c.model.dense())
    sink(Rule::kExpertTensorFolds, field, [&] { return "= 1 with a dense model: it has no routed experts to fold"; });
  else if (e < 1 || e % tp != 0)
    sink(Rule::kExpertTensorFolds, "parallel.expert_parallel_degree", [&] {
      return "= " + str(e) + " with expert_tensor_parallel_degree = 1: the expert group takes all " + str(tp) +
             " tensor-parallel ranks, so tensor_parallel_degree = " + str(tp) + " must divide it";
    });
  else if (!p.expert_beside_tensor())
    sink(Rule::kExpertTensorFolds, "parallel.placement", [&] {
      return "= \"" + p.placement.to_string() + "\" with expert_tensor_parallel_degree = 1: the expert group folds "
             "the tensor-parallel ranks in, so E must come directly outside T (as in \"PRSET\")";
    });
}

// Context parallelism with experts: Megatron-Core and torchtitan lay the expert group over the
// context-parallel ranks (and the folded tensor ranks inside them), so E counts them: it must be
// a multiple of C x T / ETP, with the mesh's E directly outside C and T.
template <class Sink>
void check_expert_context(const RunConfig& c, Sink& sink) {
  const ParallelConfig& p = c.parallel;
  if (!p.expert_spans_context()) return;
  const int64_t e = p.expert_parallel_degree, fold = p.expert_fold();
  if (e % fold != 0)
    sink(Rule::kExpertSpansContext, "parallel.expert_parallel_degree", [&] {
      return "= " + str(e) + " with context_parallel_degree = " + str(p.context_parallel_degree) +
             ": the expert group spans the context-parallel ranks" +
             (p.expert_tensor_fold() > 1 ? " and the folded tensor ranks" : "") + ", so " + str(fold) + " must divide it";
    });
  else if (!p.expert_beside_tensor())
    sink(Rule::kExpertSpansContext, "parallel.placement", [&] {
      return "= \"" + p.placement.to_string() + "\" with context_parallel_degree = " + str(p.context_parallel_degree) +
             ": the expert group spans the context-parallel ranks (directly outside T), so E must come directly "
             "outside T (as in \"PRSET\")";
    });
}

// The world, the cluster and the parallel degrees.
template <class Sink>
void check_degrees(const RunConfig& c, Sink& sink) {
  const ModelSpec& m = c.model;
  const ClusterSpec& cl = c.cluster;
  const ParallelConfig& p = c.parallel;
  const int64_t w = p.world_size;
  const int64_t e = p.expert_parallel_degree;
  const int64_t s = p.hybrid_shard_degree;

  const int64_t cluster_gpus = cl.gpus_per_node * cl.num_nodes;
  if (w > cluster_gpus)
    sink(Rule::kWorldSizeFitsCluster, "parallel.world_size", [&] {
      return "= " + str(w) + " exceeds the cluster's " + str(cl.num_nodes) + " x " +
             str(cl.gpus_per_node) + " GPUs";
    });
  else if (cl.num_nodes > 1 && w != cluster_gpus)
    sink(Rule::kWholeNodes, "parallel.world_size", [&] {
      return "= " + str(w) + " leaves GPUs of a " + str(cl.num_nodes) +
             "-node cluster idle; use whole nodes (a multiple of " + str(cl.gpus_per_node) + ")";
    });

  if (e < 1 || m.num_experts % e != 0)
    sink(Rule::kExpertDegreeDividesExperts, "parallel.expert_parallel_degree", [&] {
      return "= " + str(e) + " does not divide num_experts = " + str(m.num_experts);
    });
  if (e < 1 || w % e != 0)
    sink(Rule::kExpertDegreeDividesWorld, "parallel.expert_parallel_degree", [&] {
      return "= " + str(e) + " does not divide world_size = " + str(w);
    });
  const int64_t tp = p.tensor_parallel_degree;
  const int64_t pp = p.pipeline_parallel_degree;
  if (s < 1)
    sink(Rule::kShardDegreeResolved, "parallel.hybrid_shard_degree", [&] {
      return "= " + str(s) + " must be a resolved degree of at least 1 (0, full sharding, is "
             "written as world_size / expert_parallel_degree)";
    });
  else if (e >= 1 && tp >= 1 && pp >= 1 && p.context_parallel_degree >= 1 && e % p.expert_fold() == 0 &&
           w % (s * p.expert_data_degree() * tp * pp * p.context_parallel_degree) != 0)
    sink(Rule::kShardExpertDividesWorld, "parallel.hybrid_shard_degree", [&] {
      std::string degrees = "expert_parallel_degree = " + str(e);
      if (p.expert_fold() > 1) degrees += " / " + str(p.expert_fold()) + " folded ranks";
      if (tp != 1) degrees += ", tensor_parallel_degree = " + str(tp);
      if (p.context_parallel_degree != 1) degrees += ", context_parallel_degree = " + str(p.context_parallel_degree);
      if (pp != 1) degrees += ", pipeline_parallel_degree = " + str(pp);
      return "= " + str(s) + " times " + degrees + " does not divide world_size = " + str(w);
    });
  // Megatron's split: attention by key-value head groups (each rank keeps whole groups), the
  // MLP (and every expert) by intermediate columns; the vocabulary is padded to a multiple of T.
  if (tp < 1 || m.num_key_value_heads % tp != 0 || m.num_attention_heads % tp != 0)
    sink(Rule::kTensorDividesHeads, "parallel.tensor_parallel_degree", [&] {
      return "= " + str(tp) + " must be at least 1 and divide num_key_value_heads = " + str(m.num_key_value_heads) +
             " (and num_attention_heads = " + str(m.num_attention_heads) + ")";
    });
  // Routed experts split over ETP ranks (T unless folded), shared experts and dense blocks over T.
  const int64_t etp = p.expert_tensor_degree();
  if (tp >= 1 && (m.intermediate_size % etp != 0 || m.shared_expert_intermediate_size % tp != 0 ||
                  m.dense_intermediate_size % tp != 0))
    sink(Rule::kTensorDividesIntermediate,
         m.intermediate_size % etp != 0 && etp != tp ? "parallel.expert_tensor_parallel_degree"
                                                     : "parallel.tensor_parallel_degree",
         [&] {
           const auto [field, width] = m.intermediate_size % etp != 0
                                           ? std::pair{"intermediate_size", m.intermediate_size}
                                       : m.shared_expert_intermediate_size % tp != 0
                                           ? std::pair{"shared_expert_intermediate_size", m.shared_expert_intermediate_size}
                                           : std::pair{"dense_intermediate_size", m.dense_intermediate_size};
           return "= " + str(m.intermediate_size % etp != 0 ? etp : tp) + " does not divide " + field + " = " + str(width);
         });
  check_expert_fold(c, sink);
  check_expert_context(c, sink);
  if (p.sequence_parallel && tp == 1)
    sink(Rule::kSequenceParallelNeedsTensor, "parallel.sequence_parallel", [&] {
      return std::string("= true needs tensor_parallel_degree > 1 (it splits along the sequence over the "
                         "tensor-parallel ranks)");
    });
  // As in Megatron-Core: MoE layers under tensor parallelism take their tokens split along
  // the sequence, so that each rank routes only its share.
  if (!m.dense() && tp > 1 && !p.sequence_parallel)
    sink(Rule::kExpertTensorNeedsSequenceParallel, "parallel.sequence_parallel", [&] {
      return "= false with tensor_parallel_degree = " + str(tp) +
             " and an MoE model: the tokens are routed per rank, so sequence parallelism is needed";
    });
  const bool uneven = p.first_stage_layers > 0 || p.last_stage_layers > 0;
  if (pp < 1 || (!uneven && m.num_layers % pp != 0))
    sink(Rule::kPipelineDividesLayers, "parallel.pipeline_parallel_degree", [&] {
      return "= " + str(pp) + " must be at least 1 and divide num_layers = " + str(m.num_layers) +
             " (equal stages; first_stage_layers and last_stage_layers set uneven ends)";
    });
  else if (uneven && !stage_layers_valid(m.num_layers, p))
    sink(Rule::kPipelineDividesLayers, p.first_stage_layers > 0 ? "parallel.first_stage_layers" : "parallel.last_stage_layers",
         [&] {
           return "= " + str(p.first_stage_layers > 0 ? p.first_stage_layers : p.last_stage_layers) +
                  ": with first_stage_layers = " + str(p.first_stage_layers) + " and last_stage_layers = " +
                  str(p.last_stage_layers) + " the other " + str(pp - (p.first_stage_layers > 0) - (p.last_stage_layers > 0)) +
                  " of pipeline_parallel_degree = " + str(pp) + " stages must share the rest of num_layers = " +
                  str(m.num_layers) + " equally, each at least one block";
         });
  // Interleaved stages (Megatron-LM): P > 1, equal chunks, micro-batches in whole rounds of P.
  // Uneven end stages may hold chunks of other sizes, but at least one block each.
  const int64_t vp = p.virtual_pipeline_degree;
  const bool chunks_fit =
      uneven ? vp <= std::min(p.first_stage_layers > 0 ? p.first_stage_layers : m.num_layers,
                              p.last_stage_layers > 0 ? p.last_stage_layers : m.num_layers)
             : m.num_layers % (std::max<int64_t>(1, pp) * vp) == 0;
  if (vp < 1 || (vp > 1 && (pp <= 1 || !chunks_fit || p.gradient_accumulation_steps % std::max<int64_t>(1, pp) != 0)))
    sink(Rule::kVirtualStagesFitThePipeline, "parallel.virtual_pipeline_degree", [&] {
      if (vp >= 1 && pp <= 1)
        return "= " + str(vp) + " needs pipeline_parallel_degree > 1 (it splits pipeline stages into chunks)";
      return "= " + str(vp) + " must be at least 1 and divide the blocks of a stage (num_layers = " +
             str(m.num_layers) + " / pipeline_parallel_degree = " + str(pp) +
             "), with gradient_accumulation_steps = " + str(p.gradient_accumulation_steps) +
             " a multiple of pipeline_parallel_degree";
    });
}

// Whether every group of `size` ranks `stride` apart falls on the nodes of `node` GPUs in the
// same shape: groups inside a node, or each spanning whole nodes with as many members on each.
// Otherwise some groups stay inside a node and others straddle two (T = 6 on 8-GPU nodes: ranks
// 0-5, then 6-11), and pricing one group's shape would price the others wrong.
bool groups_share_one_shape(int64_t size, int64_t stride, int64_t node) {
  const int64_t span = size * stride;
  if (size <= 1 || node % span == 0) return true;
  return span % node == 0 && (node % stride == 0 || stride % node == 0);
}

// Each mesh dimension's groups in one shape across the nodes (costed as one). The innermost
// dimension whose groups differ is named: the dimensions outside it differ because of it.
template <class Sink>
void check_group_shapes(const RunConfig& c, Sink& sink) {
  const ParallelConfig& p = c.parallel;
  const int64_t e = p.expert_data_degree(), s = p.hybrid_shard_degree, tp = p.tensor_parallel_degree;
  const int64_t pp = p.pipeline_parallel_degree, cp = p.context_parallel_degree;
  if (e < 1 || s < 1 || tp < 1 || pp < 1 || cp < 1 || p.world_size % (e * s * tp * pp * cp) != 0) return;
  const int64_t node = std::max<int64_t>(1, std::min(p.world_size, c.cluster.gpus_per_node));
  // Powers of two on nodes of a power of two always share one shape (the search's usual case).
  auto power_of_two = [](int64_t v) { return v > 0 && (v & (v - 1)) == 0; };
  if (power_of_two(node) && power_of_two(e) && power_of_two(s) && power_of_two(tp) && power_of_two(pp) &&
      power_of_two(cp) && power_of_two(p.replica_degree()))
    return;
  // Innermost first: the placed dimensions, C just outside T.
  std::array<MeshDim, kMeshDims> inner_first{};
  size_t n = 0;
  for (size_t i = kPlacedDims; i-- > 0;) {
    inner_first[n++] = p.placement.outer_to_inner[i];
    if (p.placement.outer_to_inner[i] == MeshDim::kTensor) inner_first[n++] = MeshDim::kContext;
  }
  for (const MeshDim d : inner_first) {
    if (groups_share_one_shape(p.degree(d), p.stride(d), node)) continue;
    const char* field = d == MeshDim::kTensor     ? "parallel.tensor_parallel_degree"
                        : d == MeshDim::kContext  ? "parallel.context_parallel_degree"
                        : d == MeshDim::kExpert   ? "parallel.expert_parallel_degree"
                        : d == MeshDim::kShard    ? "parallel.hybrid_shard_degree"
                        : d == MeshDim::kPipeline ? "parallel.pipeline_parallel_degree"
                                                  : "parallel.replica_degree";
    sink(Rule::kGroupsShareOneShape, field, [&, d = d] {
      return "= " + str(p.degree(d)) + ": groups of ranks " + str(p.stride(d)) + " apart fall on nodes of " + str(node) +
             " GPUs in different shapes (not every group has as many ranks on each node), which moeplan would cost as one";
    });
    return;
  }
  // A folded expert group: E ranks ETP tensor ranks apart (check_expert_fold, check_expert_context).
  const int64_t stride = p.expert_stride();
  if (p.expert_fold() > 1 && !groups_share_one_shape(p.expert_parallel_degree, stride, node))
    sink(Rule::kGroupsShareOneShape, "parallel.expert_parallel_degree", [&] {
      return "= " + str(p.expert_parallel_degree) + " with tensor or context ranks folded in: groups of ranks " +
             str(stride) + " apart fall on nodes of " + str(node) + " GPUs in different shapes, which moeplan would cost as one";
    });
}

// Sequence, batch, checkpointing and offloading.
template <class Sink>
void check_batch(const RunConfig& c, Sink& sink) {
  const ModelSpec& m = c.model;
  const ParallelConfig& p = c.parallel;
  const TrainingConfig& t = c.training;
  const int64_t w = p.world_size;
  const int64_t tp = p.tensor_parallel_degree;
  const int64_t pp = p.pipeline_parallel_degree;

  if (t.seq_len > m.max_position_embeddings)
    sink(Rule::kSeqLenWithinPositions, "training.seq_len", [&] {
      return "= " + str(t.seq_len) + " exceeds the model's max_position_embeddings = " +
             str(m.max_position_embeddings);
    });
  if (static_cast<double>(p.micro_batch_size) * static_cast<double>(t.seq_len) > kMaxMicroBatchTokens)
    sink(Rule::kMicroBatchTokens, "parallel.micro_batch_size", [&] {
      return "= " + str(p.micro_batch_size) + " times seq_len = " + str(t.seq_len) +
             " exceeds the supported " + str(static_cast<int64_t>(kMaxMicroBatchTokens)) +
             " tokens per micro-batch";
    });
  // Every rank reads its own micro-batch, except that the T ranks of a tensor-parallel group
  // share one, the C ranks of a context-parallel group one sequence, and the P stages of a
  // pipeline pass it on: W / (C * T * P) ranks read data.
  const int64_t cp = p.context_parallel_degree;
  const int64_t readers = w / (std::max<int64_t>(1, tp) * std::max<int64_t>(1, pp) * std::max<int64_t>(1, cp));
  const double step_tokens = static_cast<double>(readers) * static_cast<double>(p.micro_batch_size) *
                             static_cast<double>(p.gradient_accumulation_steps) *
                             static_cast<double>(t.seq_len);
  if (step_tokens != static_cast<double>(t.global_batch_tokens))
    sink(Rule::kGlobalBatchMatches, "training.global_batch_tokens", [&] {
      const std::string ranks = readers == w ? std::string("world_size")
                                : cp > 1 ? "world_size / (context_parallel_degree x tensor_parallel_degree x "
                                           "pipeline_parallel_degree)"
                                         : "world_size / (tensor_parallel_degree x pipeline_parallel_degree)";
      return "= " + str(t.global_batch_tokens) + " does not equal " + ranks +
             " x micro_batch_size x gradient_accumulation_steps x seq_len = " + str(readers) + " x " +
             str(p.micro_batch_size) +
             " x " + str(p.gradient_accumulation_steps) + " x " + str(t.seq_len) + " = " +
             str(step_tokens);
    });

  // Context parallelism: each rank holds 2 of the sequence's 2C chunks (causal load balancing,
  // as Megatron-Core and torchtitan split it), and its attention runs as flash attention on
  // each pair of chunks.
  if (cp > 1 && t.seq_len % (2 * cp * std::max<int64_t>(1, p.sequence_parallel ? tp : 1)) != 0)
    sink(Rule::kContextSplitsSequence, "parallel.context_parallel_degree", [&] {
      return "= " + str(cp) + ": seq_len = " + str(t.seq_len) + " must split into 2 x " + str(cp) + " equal chunks" +
             (p.sequence_parallel && tp > 1 ? " each divisible by tensor_parallel_degree = " + str(tp) : std::string());
    });
  if (cp > 1 && c.cluster.attention != AttentionKernel::kFlash)
    sink(Rule::kContextNeedsFlashAttention, "parallel.context_parallel_degree", [&] {
      return "= " + str(cp) + " on a cluster whose attention is unfused: context parallelism runs flash attention "
             "on each chunk of keys and values as it arrives";
    });
  if (p.activation_checkpointing == Checkpointing::kLatentUpProjections && !m.mla())
    sink(Rule::kLatentUpNeedsLatentAttention, "parallel.activation_checkpointing", [&] {
      return std::string("= \"latent_up\" with a model without latent attention (kv_lora_rank = 0): it recomputes "
                         "latent attention's up projections");
    });
  if (p.activation_offloading) {
    if (p.activation_checkpointing == Checkpointing::kNone || p.activation_checkpointing == Checkpointing::kAttentionCore ||
        p.activation_checkpointing == Checkpointing::kLatentUpProjections)
      sink(Rule::kOffloadNeedsCheckpointing, "parallel.activation_offloading", [&] {
        return std::string("= true needs activation_checkpointing full or selective (only checkpointed block "
                           "inputs are offloaded)");
      });
    if (p.activation_loading_horizon < 1)
      sink(Rule::kHorizonPositive, "parallel.activation_loading_horizon", [&] {
        return "= " + str(p.activation_loading_horizon) + " must be at least 1 with offloading";
      });
    else if (p.activation_loading_horizon > m.num_layers)
      sink(Rule::kHorizonWithinLayers, "parallel.activation_loading_horizon", [&] {
        return "= " + str(p.activation_loading_horizon) + " exceeds num_layers = " + str(m.num_layers);
      });
  }
}

// Routing, precision and the learning-rate schedule.
template <class Sink>
void check_moe_and_training(const RunConfig& c, Sink& sink) {
  const ModelSpec& m = c.model;
  const ClusterSpec& cl = c.cluster;
  const TrainingConfig& t = c.training;
  const int64_t e = c.parallel.expert_parallel_degree;

  // The busiest expert can take at most every token's top-k slots: num_experts / top_k times
  // the mean.
  const double max_imbalance =
      static_cast<double>(m.num_experts) / static_cast<double>(std::max<int64_t>(1, m.experts_per_token));
  if (c.moe.expert_load_imbalance < 1.0 || c.moe.expert_load_imbalance > max_imbalance)
    sink(Rule::kLoadImbalanceRange, "moe.expert_load_imbalance", [&] {
      return "= " + str(c.moe.expert_load_imbalance) + " must be in [1, num_experts / "
             "experts_per_token] = [1, " + str(max_imbalance) + "]";
    });
  if (!c.moe.tokens_per_expert.empty()) {
    double total = 0, most = 0;
    for (double n : c.moe.tokens_per_expert) {
      total += n;
      most = std::max(most, n);
    }
    // Each token takes k distinct experts, so no expert gets more than 1/k of the slots.
    const double k = static_cast<double>(std::max<int64_t>(1, m.experts_per_token));
    if (static_cast<int64_t>(c.moe.tokens_per_expert.size()) != m.num_experts)
      sink(Rule::kTokenCountsMatchExperts, "moe.tokens_per_expert", [&] {
        return "has " + str(static_cast<int64_t>(c.moe.tokens_per_expert.size())) + " counts for num_experts = " +
               str(m.num_experts);
      });
    else if (!(total > 0) || most > total / k * (1 + 1e-9))
      sink(Rule::kTokenCountsMatchExperts, "moe.tokens_per_expert", [&] {
        return "must have a positive total and no expert above 1/experts_per_token of it (total " + str(total) +
               ", largest " + str(most) + ")";
      });
  }
  if (c.moe.global_token_shuffle && e == 1)
    sink(Rule::kTokenShuffleNeedsExperts, "moe.global_token_shuffle", [&] {
      return std::string("= true needs expert_parallel_degree > 1 (it shuffles tokens across the "
                         "expert-parallel group)");
    });
  // Megatron-Core pairs one micro-batch's forward with another's backward in the steady state
  // of 1F1B: without pipeline parallelism, or with the interleaved schedule.
  if (c.moe.overlap_exchange) {
    const ParallelConfig& par = c.parallel;
    const char* why = e == 1 ? "expert_parallel_degree > 1 (there is no exchange to overlap)"
                      : c.moe.dispatcher == Dispatcher::kAllGather ? "the alltoall or deepep dispatcher"
                      : par.pipeline_parallel_degree > 1 && par.virtual_pipeline_degree == 1
                          ? "pipeline_parallel_degree = 1 or the interleaved schedule (virtual_pipeline_degree > 1)"
                      : recomputes_moe(par.activation_checkpointing) ? "activation_checkpointing that keeps the MoE sub-block"
                                                                     : nullptr;
    if (why != nullptr)
      sink(Rule::kExchangeOverlapSchedule, "moe.overlap_exchange",
           [&] { return "= true needs " + std::string(why) + " (Megatron-Core's merged 1F1B schedule)"; });
  }

  // DeepEP across nodes (deepseek-ai/DeepEP): its kernels post RDMA from the GPU (NVSHMEM over
  // InfiniBand or RoCE), run on Hopper-class GPUs (its SM80 build has intranode kernels only;
  // FP8 tensor cores stand for the class here), and take rank / 8 as the node and rank % 8 as
  // the GPU: 8 consecutive ranks of the group on each node. Its buffers are sized from a table
  // of group sizes (deep_ep/buffer.py get_dispatch_config), which it asserts.
  if (c.moe.dispatcher == Dispatcher::kDeepEp && e > 1) {
    const ParallelConfig& par = c.parallel;
    constexpr std::array<int64_t, 10> kGroupSizes{2, 4, 8, 16, 24, 32, 64, 128, 144, 160};
    if (std::find(kGroupSizes.begin(), kGroupSizes.end(), e) == kGroupSizes.end())
      sink(Rule::kDeepEpLayout, "moe.dispatcher", [&] {
        return "= \"deepep\" with an expert group of " + str(e) +
               " ranks: DeepEP runs groups of 2, 4, 8, 16, 24, 32, 64, 128, 144 or 160";
      });
    const int64_t node = std::max<int64_t>(1, std::min(par.world_size, cl.gpus_per_node));
    const int64_t stride = par.expert_stride();
    if ((e - 1) * stride >= node) {
      const char* why = !cl.gpu_initiated_rdma() ? "a network that lets GPUs post RDMA themselves (InfiniBand or RoCE)"
                        : cl.peak_fp8_flops <= 0 ? "Hopper-class GPUs (its A100 build runs inside a node only)"
                        : stride != 1 || node != 8  ? "8 consecutive ranks of the group on each node"
                                                    : nullptr;
      if (why != nullptr)
        sink(Rule::kDeepEpLayout, "moe.dispatcher", [&] {
          return "= \"deepep\" with an expert group across nodes of " + cl.name + " (" + cl.inter_node_fabric +
                 "): DeepEP across nodes needs " + why;
        });
    }
  }
  // A drop policy or padding says how an expert's capacity is kept: without one they mean nothing.
  if (!(c.moe.capacity_factor > 0) && c.moe.pad_to_capacity)
    sink(Rule::kCapacityNeedsFactor, "moe.pad_to_capacity", [&] {
      return std::string("= true needs moe.capacity_factor > 0 (without it no token is dropped)");
    });
  if (!(c.moe.capacity_factor > 0) && c.moe.drop_policy != TokenDropPolicy::kProbs)
    sink(Rule::kCapacityNeedsFactor, "moe.drop_policy", [&] {
      return std::string("= \"position\" needs moe.capacity_factor > 0 (without it no token is dropped)");
    });
  if (t.fp8 && (cl.peak_fp8_flops <= 0 || t.precision == Precision::kFp32))
    sink(Rule::kFp8NeedsHardware, "training.fp8", [&] {
      if (t.precision == Precision::kFp32) return std::string("= true needs precision bf16 or mixed, not fp32");
      return "= true needs FP8 tensor cores; the cluster's " + cl.gpu_name + " has none (gpu.peak_fp8_flops)";
    });
  if (t.min_learning_rate > t.learning_rate)
    sink(Rule::kMinLrWithinLr, "training.min_learning_rate", [&] {
      return "= " + str(t.min_learning_rate) + " exceeds learning_rate = " + str(t.learning_rate);
    });
  if (t.warmup_steps > t.steps)
    sink(Rule::kWarmupWithinSteps, "training.warmup_steps", [&] {
      return "= " + str(t.warmup_steps) + " exceeds steps = " + str(t.steps);
    });
}

template <class Sink>
void check_config(const RunConfig& c, Sink& sink) {
  check_degrees(c, sink);
  check_group_shapes(c, sink);
  check_batch(c, sink);
  check_moe_and_training(c, sink);
  if (c.target && c.target->check) {
    RuleSink target_sink = sink.for_target(c.target->names);
    c.target->check(c, target_sink);
  }
}

}  // namespace

std::string_view rule_name(Rule rule, Target target) {
  const auto i = static_cast<size_t>(rule);
  if (i < kRuleNames.size()) return kRuleNames[i];
  if (target && i - kRuleNames.size() < target->names.size()) return target->names[i - kRuleNames.size()];
  return {};
}

std::string checkpointing_name(const ParallelConfig& p) {
  return "= \"" + std::string(name_of(kCheckpointingNames, p.activation_checkpointing)) + "\"";
}

std::string rule_number(double v) {
  std::string s = std::to_string(v);
  while (s.size() > 1 && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

bool ranks_ordered(const ParallelConfig& p, const Placement& order) {
  size_t j = 0;
  for (MeshDim d : p.placement.outer_to_inner) {
    if (p.degree(d) <= 1) continue;
    while (j < kPlacedDims && p.degree(order.outer_to_inner[j]) <= 1) ++j;
    if (j == kPlacedDims || order.outer_to_inner[j] != d) return false;
    ++j;
  }
  return true;
}

std::vector<Violation> validate_model(const ModelSpec& model) {
  MessageSink sink;
  check_model(model, sink);
  return std::move(sink.out);
}

std::vector<Violation> validate(const RunConfig& config) {
  MessageSink sink;
  check_model(config.model, sink);
  for (Violation& v : sink.out) v.field = "model." + v.field;
  check_config(config, sink);
  return std::move(sink.out);
}

RuleMask violated_rules(const RunConfig& config) {
  MaskSink sink;
  check_model(config.model, sink);
  check_config(config, sink);
  return sink.mask;
}

}  // namespace moeplan
