#pragma once
// How a training run is spread over the cluster (SMP v2 semantics, docs/architecture.md section 6), and
// the MoE and training settings that go with it.

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "moeplan/core/model_spec.h"

namespace moeplan {

// The dimensions of the device mesh [P, R, S, E, C, T]: pipeline stages, replicas, shards,
// experts, context-parallel ranks, tensor-parallel ranks. A placement orders five of them; C
// always sits directly outside T (Megatron-Core's tp-cp-ep-dp-pp order, torchtitan's mesh).
enum class MeshDim : uint8_t { kReplica, kShard, kExpert, kTensor, kPipeline, kContext };
inline constexpr size_t kMeshDims = 6;
inline constexpr size_t kPlacedDims = 5;
inline constexpr std::array<MeshDim, kMeshDims> kAllMeshDims{MeshDim::kReplica, MeshDim::kShard,    MeshDim::kExpert,
                                                             MeshDim::kTensor,  MeshDim::kPipeline, MeshDim::kContext};

// Order of the mesh dimensions from outermost to innermost, like a row-major mesh shape: in
// "RSE" the expert dimension varies fastest, so an expert group occupies consecutive ranks
// (inside one node when it is small enough).
//
// Written with the letters P, R, S, E, T, outermost first. R, S and E appear once each; P and
// T may be left out, and then P is outermost and T innermost (Megatron's order: tensor-parallel
// ranks share a node, pipeline stages are farthest apart), so the three-letter form of plans
// without tensor or pipeline parallelism keeps its meaning. SMP v1's strings are read too: "D"
// (data parallelism) stands for "RSE", "cluster" is "DPT" and "spread" is "TPD"; as in SMP the
// right-most letter is innermost.
struct Placement {
  std::array<MeshDim, kPlacedDims> outer_to_inner{MeshDim::kPipeline, MeshDim::kReplica, MeshDim::kShard,
                                                MeshDim::kExpert, MeshDim::kTensor};

  // The three-letter form when P is outermost and T innermost, else all five letters.
  std::string to_string() const;
  static std::optional<Placement> parse(std::string_view text);
  bool operator==(const Placement&) const = default;
};

// What a block recomputes in backward instead of keeping: nothing; its MoE (or MLP) sub-block
// (selective, SMP's choice of modules); the attention core alone, QK^T, softmax, dropout and
// the weighted sum (attention_core: Megatron-LM's "selective" recomputation, Korthikanti et
// al. 2022); latent attention's up projections, which make every head's query, key and value
// from the latents (latent_up: Megatron-Core's recompute module mla_up_proj); or
// the whole block from its input (full).
enum class Checkpointing : uint8_t { kNone, kSelective, kFull, kAttentionCore, kLatentUpProjections };
enum class Precision : uint8_t { kBf16, kMixed, kFp32 };
enum class LoadBalancing : uint8_t { kSinkhorn, kBalanced, kAuxLoss, kNone };
// How tokens travel to their experts: NCCL's all-to-all, an all-gather of every rank's tokens,
// or DeepEP's fused dispatch and combine kernels (deepep: across nodes each token crosses the
// network once per node it is routed to and is forwarded over NVLink there; Megatron-Core's
// flex dispatcher with DeepEP, not its HybridEP backend).
enum class Dispatcher : uint8_t { kAllToAll, kAllGather, kDeepEp };
// Which of an over-full expert's slots are dropped (Megatron-Core's --moe-token-drop-policy):
// those of the lowest router probability, or the last in token order.
enum class TokenDropPolicy : uint8_t { kProbs, kPosition };
// How the context-parallel ranks pass keys and values: around a ring, each step's transfer
// beside the attention of the chunk before (p2p: Megatron-Core's default --cp-comm-type,
// torchtitan's rotate method "alltoall"), or all-gathered whole before the attention and their
// gradients reduce-scattered after (all_gather, as Llama 3 trained).
enum class ContextExchange : uint8_t { kRing, kAllGather };

inline constexpr std::array<std::pair<std::string_view, Checkpointing>, 5> kCheckpointingNames{
    {{"none", Checkpointing::kNone},
     {"selective", Checkpointing::kSelective},
     {"full", Checkpointing::kFull},
     {"attention_core", Checkpointing::kAttentionCore},
     {"latent_up", Checkpointing::kLatentUpProjections}}};
// Whether the MoE (or MLP) sub-block runs again in backward, and with it its token exchange.
inline bool recomputes_moe(Checkpointing c) { return c == Checkpointing::kSelective || c == Checkpointing::kFull; }

inline constexpr std::array<std::pair<std::string_view, Precision>, 3> kPrecisionNames{
    {{"bf16", Precision::kBf16}, {"mixed", Precision::kMixed}, {"fp32", Precision::kFp32}}};
inline constexpr std::array<std::pair<std::string_view, LoadBalancing>, 4> kLoadBalancingNames{
    {{"sinkhorn", LoadBalancing::kSinkhorn}, {"balanced", LoadBalancing::kBalanced},
     {"aux_loss", LoadBalancing::kAuxLoss}, {"none", LoadBalancing::kNone}}};
inline constexpr std::array<std::pair<std::string_view, Dispatcher>, 3> kDispatcherNames{
    {{"alltoall", Dispatcher::kAllToAll}, {"allgather", Dispatcher::kAllGather}, {"deepep", Dispatcher::kDeepEp}}};
inline constexpr std::array<std::pair<std::string_view, TokenDropPolicy>, 2> kTokenDropPolicyNames{
    {{"probs", TokenDropPolicy::kProbs}, {"position", TokenDropPolicy::kPosition}}};
inline constexpr std::array<std::pair<std::string_view, ContextExchange>, 2> kContextExchangeNames{
    {{"p2p", ContextExchange::kRing}, {"all_gather", ContextExchange::kAllGather}}};

template <class Enum, size_t N>
std::string_view name_of(const std::array<std::pair<std::string_view, Enum>, N>& names, Enum e) {
  for (const auto& [name, value] : names)
    if (value == e) return name;
  return "?";
}

struct ParallelConfig {
  int64_t world_size = 1;
  int64_t expert_parallel_degree = 1;   // E: experts partitioned over E ranks
  int64_t hybrid_shard_degree = 1;      // S: model states sharded over S ranks (0 = W/E)
  int64_t tensor_parallel_degree = 1;   // T: each block's matrices split over T ranks (Megatron)
  // ETP: each routed expert's matrices split over ETP ranks; 0: over the T ranks, as Megatron-LM
  // does when --expert-tensor-parallel-size is unset. With ETP < T the other T / ETP
  // tensor-parallel ranks join the expert group instead (Megatron-Core's parallel folding): E
  // counts them, so E may exceed the data-parallel ranks (E = T / ETP x the mesh's E
  // dimension, expert_data_degree()).
  int64_t expert_tensor_parallel_degree = 0;
  int64_t pipeline_parallel_degree = 1; // P: the blocks split into P stages (1F1B schedule)
  // C: each sequence split over C ranks (context parallelism): every rank holds 1 / C of a
  // micro-batch's tokens, in 2C chunks so that causal attention's work is even, and attends to
  // the others' keys and values as context_exchange passes them. With E > 1 the expert group
  // spans the C ranks (Megatron-Core and torchtitan lay it over them): E counts them as it
  // counts folded tensor ranks.
  int64_t context_parallel_degree = 1;
  ContextExchange context_exchange = ContextExchange::kRing;
  // The dense parameters (everything but the routed experts), their gradients and optimizer
  // states sharded over the S x E x C ranks (the mesh's E) instead of over S alone, as FSDP2
  // does where the expert ranks come out of its shard dimension (torchtitan's dp_shard spanning
  // EP and CP); the routed experts stay sharded over S (and over C too where the expert group
  // does not span it). false: the dense parameters are replicated over the E and C ranks.
  bool dense_shard_spans_experts = false;
  // V: each stage's blocks in V chunks, run with the interleaved schedule (Megatron's virtual
  // pipeline); 1 = plain 1F1B.
  int64_t virtual_pipeline_degree = 1;
  // With T > 1: norms and the tensors between the tensor-parallel regions split along the
  // sequence over the T ranks (all-gather + reduce-scatter instead of all-reduce).
  bool sequence_parallel = false;
  Placement placement;
  Checkpointing activation_checkpointing = Checkpointing::kNone;
  bool activation_offloading = false;
  int64_t activation_loading_horizon = 1;
  int64_t micro_batch_size = 1;
  int64_t gradient_accumulation_steps = 1;
  // Optimizer states and fp32 master weights sharded over the data-parallel ranks that hold
  // the same parameters (ZeRO-1, Megatron's distributed optimizer): gradients are
  // reduce-scattered instead of all-reduced, and the updated parameters all-gathered.
  bool distributed_optimizer = false;
  // Blocks on the first and on the last pipeline stage when they differ from the others (Llama
  // 3 405B: 126 blocks on 16 stages, one fewer on each end stage, which also hold the embedding
  // and the head); 0: the blocks split evenly.
  int64_t first_stage_layers = 0;
  int64_t last_stage_layers = 0;

  // ETP resolved: T where unset.
  int64_t expert_tensor_degree() const {
    return expert_tensor_parallel_degree > 0 ? expert_tensor_parallel_degree : std::max<int64_t>(1, tensor_parallel_degree);
  }
  // The tensor-parallel ranks folded into each expert group: T / ETP (1 without folding).
  int64_t expert_tensor_fold() const {
    const int64_t etp = expert_tensor_degree();
    return tensor_parallel_degree > etp && tensor_parallel_degree % etp == 0 ? tensor_parallel_degree / etp : 1;
  }
  // Whether the expert group spans the context-parallel ranks (E > 1 and C > 1).
  bool expert_spans_context() const { return expert_parallel_degree > 1 && context_parallel_degree > 1; }
  // The ranks of each expert group that the mesh's E dimension does not count: the folded
  // tensor ranks times, where it spans them, the context ranks (1 without folding).
  int64_t expert_fold() const {
    return expert_tensor_fold() * (expert_spans_context() ? std::max<int64_t>(1, context_parallel_degree) : 1);
  }
  // The mesh's E dimension: the data-parallel ranks an expert group spans, E / fold.
  int64_t expert_data_degree() const { return expert_parallel_degree / expert_fold(); }
  // Distance in ranks between neighbours of an expert group: ETP tensor ranks (the group's
  // folded ranks innermost, C directly outside T), or the mesh's E without folding.
  int64_t expert_stride() const {
    return expert_fold() > 1 ? stride(MeshDim::kTensor) * expert_tensor_degree() : stride(MeshDim::kExpert);
  }
  // Whether the placement puts E directly outside T (and C), as a folded expert group needs.
  bool expert_beside_tensor() const {
    const auto& order = placement.outer_to_inner;
    const auto e = std::find(order.begin(), order.end(), MeshDim::kExpert);
    return e + 1 != order.end() && *(e + 1) == MeshDim::kTensor;
  }
  // R = W / (S * E * C * T * P) (with folding, the mesh's E dimension for E): replicas of
  // each shard. Only meaningful for a valid config.
  int64_t replica_degree() const {
    const int64_t rest = expert_data_degree() * hybrid_shard_degree * tensor_parallel_degree * pipeline_parallel_degree *
                         context_parallel_degree;
    return rest > 0 ? world_size / rest : 0;
  }
  // Whether the dense shard group is larger than S: the flag, with expert or context ranks to span.
  bool dense_shard_spanning() const {
    return dense_shard_spans_experts && expert_data_degree() * std::max<int64_t>(1, context_parallel_degree) > 1;
  }
  // The ranks the dense parameters are sharded over: S, or S x E (the mesh's) x C.
  int64_t dense_shard_degree() const {
    return dense_shard_spanning() ? hybrid_shard_degree * expert_data_degree() * std::max<int64_t>(1, context_parallel_degree)
                                  : hybrid_shard_degree;
  }
  // The ranks the routed experts are sharded over: S, or S x C where the dense shard spans the
  // context ranks and the expert group does not.
  int64_t expert_shard_degree() const {
    return dense_shard_spanning() && !expert_spans_context()
               ? hybrid_shard_degree * std::max<int64_t>(1, context_parallel_degree)
               : hybrid_shard_degree;
  }
  // Whether any parameters are sharded (and gathered block by block).
  bool shards_states() const { return dense_shard_degree() > 1 || expert_shard_degree() > 1; }
  // Ranks that read different sequences: R * S * E (the mesh's) = W / (C * T * P).
  int64_t data_parallel_degree() const {
    const int64_t tp = tensor_parallel_degree * pipeline_parallel_degree * context_parallel_degree;
    return tp > 0 ? world_size / tp : 0;
  }
  // Tokens of a micro-batch's sequence on one rank: seq_len / C.
  int64_t local_seq_len(int64_t seq_len) const { return seq_len / std::max<int64_t>(1, context_parallel_degree); }
  int64_t degree(MeshDim d) const {
    switch (d) {
      case MeshDim::kReplica: return replica_degree();
      case MeshDim::kShard: return hybrid_shard_degree;
      case MeshDim::kExpert: return expert_data_degree();
      case MeshDim::kTensor: return tensor_parallel_degree;
      case MeshDim::kPipeline: return pipeline_parallel_degree;
      case MeshDim::kContext: return context_parallel_degree;
    }
    return 0;
  }
  // Distance in ranks between neighbours along dimension d.
  int64_t stride(MeshDim d) const;
  bool operator==(const ParallelConfig&) const = default;
};

struct MoeConfig {
  LoadBalancing load_balancing = LoadBalancing::kSinkhorn;  // SMP's default
  Dispatcher dispatcher = Dispatcher::kAllToAll;
  // Each token exchange runs beside another micro-batch's compute: Megatron-Core's merged 1F1B
  // schedule (--overlap-moe-expert-parallel-comm), which pairs one micro-batch's forward with
  // another's backward and runs each one's all-to-alls under the other's compute.
  bool overlap_exchange = false;
  // The shared experts' forward on a stream of its own beside the forward exchanges: their
  // first GEMM and activation beside the dispatch, their second beside the combine
  // (Megatron-Core's --moe-shared-expert-overlap). Without shared experts or expert parallelism
  // it changes nothing.
  bool overlap_shared_expert = false;
  bool global_token_shuffle = false;
  // Token dropping (Megatron-Core's --moe-expert-capacity-factor): each expert takes at most
  // capacity_factor times its mean share of a micro-batch's slots (ceil(tokens x top-k /
  // experts x factor)), the rest dropped by drop_policy; 0: dropless. With pad_to_capacity every
  // expert computes its whole capacity (--moe-pad-expert-input-to-capacity).
  double capacity_factor = 0;
  TokenDropPolicy drop_policy = TokenDropPolicy::kProbs;
  bool pad_to_capacity = false;
  double aux_loss_coef = 0.001;
  double z_loss_coef = 0.0;
  // Tokens of the busiest expert over the mean (1 = uniform routing); used when
  // tokens_per_expert is empty.
  double expert_load_imbalance = 1.0;
  // Token-expert slots each expert received (given, or measured by a run); empty: use
  // expert_load_imbalance. Only the proportions matter.
  std::vector<double> tokens_per_expert;
  int64_t random_seed = 12345;
  bool operator==(const MoeConfig&) const = default;
};

// Whether moe.overlap_shared_expert takes effect: the model has shared experts and there is a
// token exchange (E > 1) for their forward to run beside.
inline bool overlaps_shared_expert(const ModelSpec& model, const MoeConfig& moe, const ParallelConfig& p) {
  return moe.overlap_shared_expert && model.shared_experts() && p.expert_parallel_degree > 1;
}

struct TrainingConfig {
  int64_t seq_len = 2048;
  int64_t global_batch_tokens = 0;
  Precision precision = Precision::kBf16;
  // Matrix multiplies of the blocks in FP8 (Transformer Engine's recipe: inputs and weights cast
  // with per-tensor scales, outputs and everything else in the compute dtype).
  bool fp8 = false;
  // Mixed precision: gradients accumulated and reduced in fp32 (Megatron-LM with bf16, FSDP's
  // fp32 reduce, Llama 3); false: in bf16 (Megatron-Core's default, NeMo's grad_sync_dtype bf16).
  bool fp32_gradients = true;
  int64_t steps = 100;
  double learning_rate = 1e-4;
  double min_learning_rate = 1e-5;
  int64_t warmup_steps = 10;
  double weight_decay = 0.1;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double max_grad_norm = 1.0;
  int64_t seed = 12345;
  // The prepared data folder (`moeplan data prepare`) the plan trains on, as `search --data`
  // was given it; empty when the plan names none (`moeplan run --data` then says which).
  std::string data;
  bool operator==(const TrainingConfig&) const = default;
};

// Blocks on pipeline stage `stage` (0 .. P - 1): first_stage_layers and last_stage_layers on
// the end stages where given, the rest split evenly over the other stages.
int64_t stage_layers(int64_t num_layers, const ParallelConfig& p, int64_t stage);
// Whether the uneven end stages leave the other stages an equal, positive share.
bool stage_layers_valid(int64_t num_layers, const ParallelConfig& p);
// Pipeline stage `stage`'s blocks and, of them, those with routed experts. Under interleaving
// (V > 1, even stages) the stage holds V chunks of L / (P V) blocks: chunks stage, stage + P,
// ...; with uneven end stages it is counted as its blocks in order. The last stage also runs
// the multi-token prediction blocks (ModelSpec::mtp_layers), as Megatron-Core places them.
struct StageBlockCounts {
  int64_t layers = 0;
  int64_t moe_layers = 0;
};
StageBlockCounts stage_block_counts(const ModelSpec& model, const ParallelConfig& p, int64_t stage);
// The stage's blocks as a model of their own, its dense blocks (ModelSpec::first_dense_layers)
// first: the order of a stage's blocks changes neither its memory nor the sum of its times. It
// keeps the model's dense_intermediate_size, so that the other stages' dense blocks can be
// priced from it. The last stage's keeps mtp_layers (its blocks() are the counts above), the
// others have none.
ModelSpec stage_blocks(const ModelSpec& model, const ParallelConfig& p, int64_t stage);

ParallelConfig read_parallel(const Json& json, const std::string& path, Diagnostics& d);
MoeConfig read_moe(const Json& json, const std::string& path, Diagnostics& d);
TrainingConfig read_training(const Json& json, const std::string& path, Diagnostics& d);
Json to_json(const ParallelConfig& p);
Json to_json(const MoeConfig& m);
Json to_json(const TrainingConfig& t);

// Short form for tables and messages: "E8 S2 R1 RSE ckpt=full offload=h2 mbs=1 ga=8" (with
// " T4 sp" or " P8" after R where those are used).
std::string describe(const ParallelConfig& p);

}  // namespace moeplan
