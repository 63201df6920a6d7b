#pragma once
// The cluster: a number of identical nodes, each with GPUs on an intra-node fabric (NVSwitch)
// and a network card shared by the node's GPUs (EFA). Numbers are per GPU unless named per node.

#include <array>
#include <cctype>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeplan/core/fit.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/model_spec.h"

namespace moeplan {

// Achieved fraction of peak matrix-multiply rate for a GEMM of a given size.
struct EfficiencyPoint {
  double flops = 0;       // FLOPs of one GEMM
  double efficiency = 0;  // achieved / peak, in (0, 1]
  bool operator==(const EfficiencyPoint&) const = default;
};

// How the training framework runs a transformer block, which decides what it keeps for backward
// (docs/memory-model.md). kFused: flash attention (a log-sum-exp per head, not the T x T
// probabilities) and fused RMSNorm and SwiGLU kernels, as Megatron, SMP and torchtitan run on
// GPUs. kEager: one LibTorch operation after another, as moeplan's executor runs: the softmax
// probabilities, the normalised rows inside each RMSNorm, SiLU's output and GQA's repeated keys
// and values are kept too.
enum class Kernels : uint8_t { kFused, kEager };
inline constexpr std::array<std::pair<std::string_view, Kernels>, 2> kKernelNames{
    {{"fused", Kernels::kFused}, {"eager", Kernels::kEager}}};

// How the framework computes the attention core. kFlash: one tiled kernel that never writes the
// T x T scores (FlashAttention, cuDNN, PyTorch's scaled-dot-product attention), causal work
// halved. kUnfused: the scores as a batched GEMM over the whole square, a softmax kernel (and
// dropout) over it, and a second batched GEMM, as Megatron-LM ran before flash attention
// (its fused scale-mask-softmax) and eager PyTorch runs. The default follows `kernels`.
enum class AttentionKernel : uint8_t { kFlash, kUnfused };
inline constexpr std::array<std::pair<std::string_view, AttentionKernel>, 2> kAttentionKernelNames{
    {{"flash", AttentionKernel::kFlash}, {"unfused", AttentionKernel::kUnfused}}};

// What a rank computes on: a CUDA GPU (every shipped GPU profile), or a CPU process (local-cpu
// and the profiles `moeplan calibrate` measures on CPU ranks). `moeplan run` puts a rank on
// cuda:LOCAL_RANK for a CUDA profile when the machine has the GPU.
enum class DeviceKind : uint8_t { kCuda, kCpu };
inline constexpr std::array<std::pair<std::string_view, DeviceKind>, 2> kDeviceKindNames{
    {{"cuda", DeviceKind::kCuda}, {"cpu", DeviceKind::kCpu}}};

// A collective's own alpha-beta pair, fitted on measured times (moeplan calibrate); it replaces
// the level's latency and bandwidth for that collective. Zero: not measured.
struct CollectiveFit {
  double latency_s = 0;              // per step of the algorithm, as the cost model counts them
  double bandwidth_bytes_per_s = 0;  // of the bytes the cost model counts for it
  // Times measured at the exact message sizes a model uses (bytes as the cost model is given
  // them: all-gather output, others input), which win over the line at those sizes: transports
  // have sizes they handle worse than their neighbours.
  CurvePoints points;
  bool given() const { return bandwidth_bytes_per_s > 0; }
  // The measured seconds at `bytes` (within 1%), or a negative number.
  double measured_at(double bytes) const;
  bool operator==(const CollectiveFit&) const = default;
};

// Measured times of the executor's own operations at one model's shapes (moeplan calibrate),
// with every rank of a node busy at once. Where the plan's model has these shapes they replace
// the FLOP-based estimate of those operations; for other shapes the FLOP model applies.
// The time a collective takes beyond its back-to-back time when the ranks computed before it:
// waking the communication threads, and waiting for the rank that fell behind (cores of a
// shared machine do not all run at one pace). Per kind, (seconds of compute a rank did since its
// previous collective, extra seconds), at increasing compute.
struct AfterCompute {
  CurvePoints all_reduce, all_gather, all_to_all;

  bool empty() const { return all_reduce.empty() && all_gather.empty() && all_to_all.empty(); }
  // The curve of a trace category (all_reduce, all_gather, all_to_all, reduce_scatter: gloo
  // builds it from an all-to-all); nullptr for others.
  const CurvePoints* of(std::string_view category) const;
  bool operator==(const AfterCompute&) const = default;
};
inline constexpr std::array<std::string_view, 3> kAfterComputeKinds = {"all_reduce", "all_gather", "all_to_all"};

// A curve of AfterCompute at `compute_s`: 0 without compute; below the first point the first
// point's share of its compute; between points read linearly; beyond the last point its share
// of its compute, times compute_s (the wait for a rank that falls behind grows with the work).
double after_compute_seconds(const CurvePoints& curve, double compute_s);

// The operations one rank runs when a block's matrices are split over T ranks (Megatron's
// tensor parallelism, with sequence parallelism): attention with 1/T of the heads over the
// whole sequence, each expert with 1/T of its intermediate width, the head with 1/T of the
// vocabulary. Axes as OpTimes's curves of the same names. The router, the routing and the
// dispatch run on the whole sequence at every split (OpTimes's router curves).
struct TensorSplitTimes {
  int64_t tensor_parallel_degree = 2;
  CurvePoints attention_forward, attention_backward, expert_forward, expert_backward, head;
  // The executor's whole micro-batch at this split against its tokens (optional, the four
  // together): its compute, forward with the loss and backward, without the time spent inside
  // the tensor group's collectives, and that time, per micro-batch.
  CurvePoints micro_batch_forward, micro_batch_backward, collectives_forward, collectives_backward;
  bool operator==(const TensorSplitTimes&) const = default;
};
inline constexpr std::array<std::string_view, 9> kTensorSplitCurves{
    "attention_forward",   "attention_backward",   "expert_forward",      "expert_backward",     "head",
    "micro_batch_forward", "micro_batch_backward", "collectives_forward", "collectives_backward"};
// The first five are required; the rest come together or not at all.
inline constexpr size_t kRequiredTensorSplitCurves = 5;

// The executor's whole micro-batch on a mesh whose routed experts are split over E ranks (T = 1,
// the same tokens on every rank), against the tokens of a micro-batch: its compute (the time
// inside the expert group's exchanges left out) and that time, forward and backward.
struct ExpertSplitTimes {
  int64_t expert_parallel_degree = 0;
  CurvePoints micro_batch_forward, micro_batch_backward, exchange_forward, exchange_backward;
  bool operator==(const ExpertSplitTimes&) const = default;
};
inline constexpr std::array<CurvePoints ExpertSplitTimes::*, 4> kExpertSplitCurveFields{
    &ExpertSplitTimes::micro_batch_forward, &ExpertSplitTimes::micro_batch_backward,
    &ExpertSplitTimes::exchange_forward, &ExpertSplitTimes::exchange_backward};
inline constexpr std::array<std::string_view, 4> kExpertSplitCurves{"micro_batch_forward", "micro_batch_backward",
                                                                    "exchange_forward", "exchange_backward"};

// The executor's whole micro-batch on a mesh whose parameters, gradients and optimizer states
// are sharded over S ranks (E = T = 1, R = 1, the same tokens on every rank), against the tokens
// of a micro-batch, forward with the loss and backward: its compute together with every unit's
// all-gather (prefetched, as a run gathers) and gradient reduce-scatter, and what these take
// from the compute beside them.
struct ShardSplitTimes {
  int64_t hybrid_shard_degree = 0;
  CurvePoints micro_batch_forward, micro_batch_backward;
  bool operator==(const ShardSplitTimes&) const = default;
};
inline constexpr std::array<CurvePoints ShardSplitTimes::*, 2> kShardSplitCurveFields{
    &ShardSplitTimes::micro_batch_forward, &ShardSplitTimes::micro_batch_backward};
inline constexpr std::array<std::string_view, 2> kShardSplitCurves{"micro_batch_forward", "micro_batch_backward"};

// The blocks around the measured operations, as the model measured had them: its attention's
// kind (q/k norms, latent attention's widths), shared experts, dense blocks and multi-token
// prediction. Measured times apply to a model with the same blocks; its whole micro-batches
// ran them all.
struct OpTimesBlocks {
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_rope_head_dim = 0, v_head_dim = 0, shared_expert_intermediate_size = 0,
          dense_intermediate_size = 0, first_dense_layers = 0, moe_layer_step = 1, moe_layer_offset = 0,
          mtp_layers = 0;
  bool qk_norm = false, shared_expert_gate = false;

  static OpTimesBlocks of(const ModelSpec& m);
  bool operator==(const OpTimesBlocks&) const = default;
};
// Its integers as profile fields (optional, at their defaults when absent).
struct OpTimesBlockField {
  std::string_view name;
  int64_t OpTimesBlocks::*field;
  int64_t least, most, fallback;
};
inline constexpr std::array<OpTimesBlockField, 10> kOpTimesBlockFields{{
    {"q_lora_rank", &OpTimesBlocks::q_lora_rank, 0, int64_t{1} << 20, 0},
    {"kv_lora_rank", &OpTimesBlocks::kv_lora_rank, 0, int64_t{1} << 20, 0},
    {"qk_rope_head_dim", &OpTimesBlocks::qk_rope_head_dim, 0, 1 << 16, 0},
    {"v_head_dim", &OpTimesBlocks::v_head_dim, 0, 1 << 16, 0},
    {"shared_expert_intermediate_size", &OpTimesBlocks::shared_expert_intermediate_size, 0, int64_t{1} << 22, 0},
    {"dense_intermediate_size", &OpTimesBlocks::dense_intermediate_size, 0, int64_t{1} << 22, 0},
    {"first_dense_layers", &OpTimesBlocks::first_dense_layers, 0, 1 << 16, 0},
    {"moe_layer_step", &OpTimesBlocks::moe_layer_step, 1, 1 << 16, 1},
    {"moe_layer_offset", &OpTimesBlocks::moe_layer_offset, 0, 1 << 16, 0},
    {"mtp_layers", &OpTimesBlocks::mtp_layers, 0, 1 << 16, 0},
}};

struct OpTimes {
  // The shapes measured.
  int64_t hidden_size = 0, intermediate_size = 0, num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0,
          num_experts = 0, experts_per_token = 0, vocab_size = 0, seq_len = 0;
  std::string precision;  // "bf16", "mixed" or "fp32"
  OpTimesBlocks blocks;
  // Blocks of the model whose whole micro-batches were measured (micro_batch_*); 0 without them.
  int64_t num_layers = 0;
  // Seconds against tokens of a micro-batch (attention, router, head: norm, lm head, loss and
  // embedding, forward and backward together), rows of one expert (expert), parameters of a
  // rank's shard (optimizer: clipping and AdamW).
  CurvePoints attention_forward, attention_backward, router_forward, router_backward, expert_forward,
      expert_backward, head, optimizer;
  // The executor's whole micro-batch against its tokens (its own model on one rank, E = S = 1,
  // balanced routing): forward with the loss, and backward. What it takes beyond the
  // operations above (tensor allocation, gradient assembly into the flat units, bookkeeping)
  // the simulator adds to every block. Optional.
  CurvePoints micro_batch_forward, micro_batch_backward;
  // The same whole micro-batch with every block checkpointed whole (full recomputation): its
  // forward runs the blocks without autograd, its backward runs each again with it first. What
  // these take against the two above prices a fully recomputed block's forward and recompute.
  // Optional; with the two above.
  CurvePoints recomputed_micro_batch_forward, recomputed_micro_batch_backward;
  // The same operations split over T ranks, one entry per T measured. Optional.
  std::vector<TensorSplitTimes> tensor_splits;
  // The whole micro-batch with the experts split over E ranks, one entry per E. Optional.
  std::vector<ExpertSplitTimes> expert_splits;
  // The whole micro-batch with the states sharded over S ranks, one entry per S. Optional.
  std::vector<ShardSplitTimes> shard_splits;

  bool empty() const { return attention_forward.empty(); }
  // The times measured at a split of t ranks; nullptr when none were.
  const TensorSplitTimes* split(int64_t t) const;
  // The whole micro-batch measured with the experts over e ranks; nullptr when it was not.
  const ExpertSplitTimes* expert_split(int64_t e) const;
  // The whole micro-batch measured with the states sharded over s ranks; nullptr when it was not.
  const ShardSplitTimes* shard_split(int64_t s) const;
  bool operator==(const OpTimes&) const = default;
};
inline constexpr std::array<std::string_view, 12> kOpTimeCurves{
    "attention_forward",   "attention_backward",   "router_forward",
    "router_backward",     "expert_forward",       "expert_backward",
    "head",                "optimizer",            "micro_batch_forward",
    "micro_batch_backward", "recomputed_micro_batch_forward", "recomputed_micro_batch_backward"};
// The first eight are required; the whole micro-batches optional.
inline constexpr size_t kRequiredOpTimeCurves = 8;

struct ClusterSpec {
  std::string name;  // instance type, e.g. "p4d.24xlarge"
  std::string description;
  int64_t gpus_per_node = 0;
  int64_t num_nodes = 1;  // set when a search sizes the cluster; profiles leave it at 1

  std::string gpu_name;
  DeviceKind device = DeviceKind::kCuda;
  int64_t gpu_memory_bytes = 0;
  double peak_bf16_flops = 0;  // dense, per GPU, per second
  double peak_fp32_flops = 0;
  double hbm_bandwidth_bytes_per_s = 0;
  std::vector<EfficiencyPoint> matmul_efficiency;  // sorted by flops
  // The GPU's kernel model (docs/simulator.md, "Kernels"); a profile without it (a CPU) times
  // GEMMs by matmul_efficiency alone.
  double peak_fp8_flops = 0;               // dense; 0 where the GPU has no FP8 tensor cores
  int64_t streaming_multiprocessors = 0;   // 0: no tile model
  double matmul_peak_efficiency = 0;       // best achieved / peak bf16 rate of large GEMMs
  double fp8_matmul_peak_efficiency = 0;   // the same for FP8 GEMMs
  double memory_bound_efficiency = 1.0;    // achieved / datasheet bandwidth of streaming kernels
  double kernel_overhead_s = 0;            // fixed time of each kernel (launch, ramp, tail)
  double flash_attention_efficiency = 0;   // flash attention forward + backward / peak bf16

  std::string intra_node_fabric;
  double intra_node_bandwidth_bytes_per_s = 0;  // per GPU, one direction
  double intra_node_latency_s = 0;          // per step of a ring
  double collective_base_latency_s = 0;     // per collective, whatever its size (NCCL's base latency)
  // Measured per collective on the intra-node level (empty on profiles that are not calibrated).
  CollectiveFit all_gather_fit, reduce_scatter_fit, all_reduce_fit, all_to_all_fit;
  std::string inter_node_fabric;
  // Whether the network lets GPUs post RDMA themselves (InfiniBand or RoCE, through NVSHMEM's
  // IBGDA), as DeepEP's kernels across nodes need; AWS EFA does not.
  bool gpu_initiated_rdma() const {
    std::string fabric = inter_node_fabric;
    for (char& ch : fabric) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return fabric.find("infiniband") != std::string::npos || fabric.find("roce") != std::string::npos;
  }
  double inter_node_bandwidth_bytes_per_s = 0;  // per node, one direction, shared by its GPUs
  double inter_node_latency_s = 0;

  int64_t host_memory_bytes = 0;           // per node
  double pcie_bandwidth_bytes_per_s = 0;   // per GPU, one direction
  // CPU ranks: the processors a node's ranks share (fewer than its ranks when they are
  // oversubscribed); 0 where each rank has a device of its own.
  int64_t host_processors = 0;

  int64_t framework_overhead_bytes = 0;  // CUDA context, communicator buffers, kernels
  double fragmentation_factor = 1.0;     // allocator overhead on dynamic allocations
  Kernels kernels = Kernels::kFused;
  AttentionKernel attention = AttentionKernel::kFlash;
  // How much slower compute runs while a collective runs beside it on the same GPU (its SMs and
  // memory bandwidth are shared): 0.1 = 10% slower for the overlapped time.
  double overlap_slowdown = 0;
  // Whether collectives and copies run beside compute. True on GPUs (their own engines and
  // streams); false where they take the same processor as compute, like CPU ranks with as
  // many ranks as cores: there a collective's time adds to the compute's.
  bool comm_overlaps_compute = true;
  // Whether the framework starts the data-parallel gradient sync during the backward pass
  // (bucket by bucket, as PyTorch DDP, FSDP and Megatron-Core's overlap_grad_reduce do) or
  // only once the last micro-batch's backward is done (Megatron-LM through 2022, DeepSpeed's
  // pipeline engine).
  bool overlap_gradient_sync = true;
  // The gradient sync runs beside the last micro-batch's backward: where the framework starts
  // it there and collectives run beside compute at all.
  bool gradient_sync_overlaps_backward() const { return comm_overlaps_compute && overlap_gradient_sync; }
  OpTimes op_times;
  // What a collective takes beyond its own time when it follows compute (measured on CPU ranks;
  // empty elsewhere).
  AfterCompute after_compute;
  int64_t memory_headroom_bytes = 0;     // kept free on purpose

  // What running the instances costs (the profile's "cost" object; 0 where not given): the
  // on-demand price of one instance for an hour, in US dollars, and how often a node fails.
  double instance_price_per_hour = 0;
  double node_failures_per_hour = 0;

  SourceMap sources;  // field path -> public source of the number

  int64_t world_size() const { return gpus_per_node * num_nodes; }
  // Device memory a plan may use: capacity minus the headroom.
  int64_t usable_memory_bytes() const { return gpu_memory_bytes - memory_headroom_bytes; }
  // Achieved fraction of peak for a GEMM of `flops` (piecewise linear in log10(flops)).
  double efficiency_at(double flops) const;
  // Whether GEMMs are timed by shape (tiles on the SMs) rather than by the efficiency curve.
  bool has_kernel_model() const { return streaming_multiprocessors > 0 && matmul_peak_efficiency > 0; }

  bool operator==(const ClusterSpec&) const = default;
};

// The curve of `op_times` named `name` (one of kOpTimeCurves).
CurvePoints& op_time_curve(OpTimes& t, std::string_view name);
const CurvePoints& op_time_curve(const OpTimes& t, std::string_view name);
// A tensor split's curve by its name in kTensorSplitCurves.
CurvePoints& split_curve(TensorSplitTimes& t, std::string_view name);
const CurvePoints& split_curve(const TensorSplitTimes& t, std::string_view name);

// Hardware profile (profiles/hardware/*.json). Every number may be written as
// {"value": x, "source": "..."}; shipped profiles do so for every number.
ClusterSpec cluster_from_json(const Json& json, const std::string& origin);
ClusterSpec read_cluster_file(const std::string& path);
Json to_json(const ClusterSpec& cluster);

// Reads a cluster object found at `path` (e.g. "cluster" inside a plan).
ClusterSpec read_cluster(const Json& json, const std::string& path, Diagnostics& d);
void check_cluster(const ClusterSpec& c, Diagnostics& d, const std::string& prefix);

}  // namespace moeplan
