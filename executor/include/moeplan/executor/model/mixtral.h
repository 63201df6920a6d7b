#pragma once
// Mixtral exactly as Hugging Face's MixtralForCausalLM defines it: RMSNorm, RoPE, grouped-query
// attention with an optional sliding window, and the sparse MoE block (bias-free router, fp32
// softmax, top-k, renormalised weights, SwiGLU experts), with an untied lm head. With
// spec.qk_norm, Qwen3-MoE's attention (Qwen3MoeForCausalLM): an RMSNorm over each head's query
// and key (head_dim weights q_norm and k_norm, shared by the heads) before the rotary embedding;
// its sparse block is Mixtral's with the top-k weights renormalised (norm_topk_prob). With
// spec.shared_experts(), a SwiGLU feed-forward layer every token passes beside the routed
// experts (block_sparse_moe.shared_experts.w1/w2/w3, optionally gated by a sigmoid of
// block_sparse_moe.shared_expert_gate, as Qwen2-MoE gates its shared expert). Blocks the model
// makes dense (spec.moe_layer(l) false: DeepSeek's first_k_dense_replace, Qwen2-MoE's
// decoder_sparse_step) have one SwiGLU feed-forward layer of dense_intermediate_size instead of
// the sparse block (mlp.w1/w2/w3), and no router. With spec.mla(), DeepSeek's multi-head latent
// attention (DeepseekV3Attention's parameters and interleaved rotary pairs) in place of q, k, v.
// With spec.mtp_layers, DeepSeek-V3's multi-token prediction blocks after the decoder
// (model.layers.<L + k - 1>.*, their own loss weighted into the total).
// The router scores and chooses as the model's
// router_scoring, router_groups and routed_scaling_factor say (routing.h: route), DeepSeek-V3's
// sigmoid router with its balancing bias among them.
//
// The model is a list of named parameters (Hugging Face names) plus a forward function over
// them. Experts are separate parameters so that a rank can hold any subset of them, and every
// parameter is initialised from (seed, name) alone, so the initial weights of a run do not
// depend on how it is later split over ranks.

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"
#include "moeplan/executor/model/routing.h"

namespace moeplan::executor {

enum class InitKind : uint8_t { kNormal, kOnes };

struct ParamInfo {
  std::string name;            // Hugging Face name, e.g. "model.layers.0.block_sparse_moe.experts.3.w1.weight"
  std::vector<int64_t> shape;  // as in Hugging Face (Linear weights are [out, in])
  int64_t block = 0;           // 0: embedding; 1..B: block B-1 (decoder, then multi-token prediction); B+1: final norm and lm head
  int64_t expert = -1;         // expert index, -1 for dense parameters
  InitKind init = InitKind::kNormal;
  double init_std = 0;
  bool weight_decay = true;  // matrices decay; norm weights do not (as Megatron does)

  int64_t numel() const;
};

// Every parameter of the model in Hugging Face's order.
std::vector<ParamInfo> mixtral_parameters(const ModelSpec& spec);

// How a parameter is split over the T ranks of a tensor-parallel group (Megatron-LM): the
// column-parallel layers (q, k, v, w1, w3) and the vocabulary-parallel embedding and lm head
// by rows of their [out, in] weight, the row-parallel ones (o, w2) by columns; norms and the
// router stay whole on every rank.
enum class TensorSplit : uint8_t { kWhole, kRows, kColumns };
TensorSplit tensor_split(const ParamInfo& info);
// The part of a whole parameter that tensor-parallel rank `index` of `ranks` holds (a view).
torch::Tensor tensor_part(const torch::Tensor& whole, TensorSplit split, int64_t index, int64_t ranks);
// The parameter as rank `index` of `ranks` holds it: same name, the shape of its part.
ParamInfo tensor_part_info(const ParamInfo& info, int64_t ranks);

// The seed of one parameter: a function of the run's seed and the parameter's name only.
uint64_t parameter_seed(uint64_t run_seed, const std::string& name);

// Fills t (the whole parameter, fp32 or lower) with its deterministic initial values.
void initialize_parameter(torch::Tensor& t, const ParamInfo& info, uint64_t run_seed);

// Parameters of one rank. Built on the meta device (no memory), then materialised and
// initialised; `check_materialized` proves nothing is left on meta.
class ParameterSet {
 public:
  // Shapes only: every tensor is on the meta device.
  static ParameterSet on_meta(std::vector<ParamInfo> infos);
  void materialize(uint64_t run_seed, torch::ScalarType dtype);
  // Throws std::logic_error naming the first parameter still on the meta device.
  void check_materialized() const;
  // Moves every tensor to `device` (before gradients or an optimizer refer to them).
  void move_to(const torch::Device& device);

  const std::vector<ParamInfo>& infos() const { return infos_; }
  std::vector<torch::Tensor>& tensors() { return tensors_; }
  const std::vector<torch::Tensor>& tensors() const { return tensors_; }
  int64_t numel() const;
  // Index of a parameter by name, or -1.
  int64_t find(const std::string& name) const;

 private:
  std::vector<ParamInfo> infos_;
  std::vector<torch::Tensor> tensors_;
};

// Tensors of one decoder layer, viewed by role. q_norm and k_norm are undefined without
// spec.qk_norm, the shared experts' without spec.shared_experts() (their gate without
// spec.shared_expert_gate).
struct LayerWeights {
  torch::Tensor input_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_attention_norm, router;
  // Latent attention's (spec.mla(); q_proj then only without a query latent): the query
  // latent's down projection, norm and up projection, the key-value latent's (with the shared
  // rotary key) and its norm and up projection.
  torch::Tensor q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj;
  std::vector<torch::Tensor> w1, w2, w3;  // per expert
  // The same experts stacked for the grouped kernel where the trainer stacks them (ExpertStacks):
  // w1 over w3 [experts, 2 x ffn, hidden] and w2 [experts, hidden, ffn]; undefined otherwise,
  // and then each expert runs its own matrix multiplies.
  torch::Tensor experts_w13, experts_w2;
  torch::Tensor shared_w1, shared_w2, shared_w3, shared_gate;
  // A dense block's feed-forward layer (no router, no experts): mlp.w1/w2/w3.
  torch::Tensor dense_w1, dense_w2, dense_w3;
  // A multi-token prediction block's own (DeepSeek-V3's names): the norms of the embedding and of
  // the previous depth's output, their joint projection (2 x hidden -> hidden, the embedding's
  // half first, as DeepSeek's checkpoints and Megatron-Core join them) and the norm before the
  // shared head.
  torch::Tensor mtp_enorm, mtp_hnorm, mtp_eh_proj, mtp_head_norm;
  // Under sigmoid scoring, the balancing bias of each expert [experts] fp32: a buffer the
  // trainer moves after each step (update_expert_bias), not a parameter; undefined otherwise.
  torch::Tensor expert_bias;
  bool has_experts() const { return router.defined(); }

  // Binds `t` to the role its name says: the name after "model.layers.<l>.", for example
  // "self_attn.q_proj.weight" or "block_sparse_moe.experts.3.w1.weight" (expert 3 of those
  // this layer holds counts from `first_expert`). Throws std::logic_error on a name of no role.
  void bind(std::string_view role, const torch::Tensor& t, int64_t first_expert = 0);
};

struct MixtralWeights {
  torch::Tensor embed_tokens;
  std::vector<LayerWeights> layers;
  torch::Tensor norm, lm_head;

  // Binds tensors (one per mixtral_parameters(spec), in its order) to their roles by name, and
  // each block with experts to its row of `expert_bias` [moe blocks, experts] where defined.
  static MixtralWeights bind(const ModelSpec& spec, const std::vector<torch::Tensor>& tensors,
                             const torch::Tensor& expert_bias = {});
};

struct ForwardResult {
  torch::Tensor logits;                      // [B, T, vocab], fp32 as in Hugging Face
  std::vector<torch::Tensor> mtp_logits;     // per multi-token prediction depth k: [B, T, vocab], fp32
  std::vector<torch::Tensor> router_logits;  // per block with experts [B*T, num_experts], compute dtype
  // Per block with experts (the model's moe_blocks(), by moe_row(); dense blocks have none):
  torch::Tensor tokens_per_expert;           // [moe blocks, num_experts] int64: token-expert slots
  torch::Tensor dropped_slots;               // [moe blocks] int64: of those, the ones dropped at capacity
  torch::Tensor hidden;                      // a pipeline stage's output, when it is not the last
  // Per layer, when the routing was replayed (RouteOverride): the top-k slots the load-balancing
  // loss counts.
  std::vector<torch::Tensor> top_k;
  // [blocks] int64, 1 where a block's output held a NaN or an Inf (its part on this
  // rank): where a non-finite loss began. Kept on the device, read only when a step went wrong.
  torch::Tensor nonfinite_layers;
};

// A [layers, num_experts] count tensor (tokens_per_expert) as rows on the host.
std::vector<std::vector<int64_t>> slot_table(const torch::Tensor& counts);

// Adds 1 to nonfinite_layers[layer] when `output` holds a NaN or an Inf, without a host sync.
void note_nonfinite(ForwardResult& out, int64_t layer, const torch::Tensor& output);

// With `replay`, each layer sends its tokens to the experts it returns instead of its own
// choice (a rehearsal's reference, routing_record.h), and keeps the slots it says were kept.
// moe's load balancing routes, and its capacity factor drops (routing.h: slot_list).
ForwardResult mixtral_forward(const ModelSpec& spec, const MixtralWeights& weights,
                              const torch::Tensor& input_ids, const MoeConfig& moe,
                              const RouteOverride& replay = {});
// Dropless, routed by `balancing`.
ForwardResult mixtral_forward(const ModelSpec& spec, const MixtralWeights& weights,
                              const torch::Tensor& input_ids, LoadBalancing balancing,
                              const RouteOverride& replay = {});

struct LossTerms {
  torch::Tensor total;       // prediction + aux_coef * aux (aux_loss balancing only) + z_coef * z
  torch::Tensor lm;          // next-token cross entropy, nats per predicted token
  torch::Tensor mtp;         // the multi-token prediction depths' mean cross entropy (undefined without)
  torch::Tensor prediction;  // lm + mtp_loss_weight * mtp: the vocabulary's terms
  torch::Tensor aux;    // Hugging Face load_balancing_loss_func (computed for every method)
  torch::Tensor z;      // router z-loss
};

// Building blocks of the forward pass, shared by the sharded model.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
struct Rope {
  torch::Tensor cos, sin;  // [T, head_dim], compute dtype
};
Rope rope_tables(const ModelSpec& spec, int64_t seq_len, torch::ScalarType dtype,
                 const torch::Device& device = torch::kCPU);
// The attention mask beyond causality: none (an undefined tensor) when the model attends to
// every earlier position, else 0 where attention is allowed and -inf in the future and beyond
// the sliding window: [T, T].
torch::Tensor attention_mask_bias(const ModelSpec& spec, int64_t t, torch::ScalarType dtype,
                                  const torch::Device& device = torch::kCPU);
// Self-attention of x [B, T, hidden] with the q/k/v/o projections of w (no norm, no residual):
// LibTorch's scaled-dot-product attention (flash attention on CPU and GPU where it applies),
// causal, or under mask_bias where that is defined.
torch::Tensor attention(const ModelSpec& spec, const LayerWeights& w, const torch::Tensor& x, const Rope& rope,
                        const torch::Tensor& mask_bias);
// The same with another core: core(q [B, heads, T, d], k, v [B, kv heads, T, d]) -> [B, heads, T, d]
// in place of the causal flash attention (context parallelism's, context_attention.h).
using AttentionCore = std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v)>;
torch::Tensor attention(const ModelSpec& spec, const LayerWeights& w, const torch::Tensor& x, const Rope& rope,
                        const AttentionCore& core);
// One SwiGLU expert on rows [n, hidden]: w2(silu(w1 x) * w3 x).
torch::Tensor expert_ffn(const torch::Tensor& in, const torch::Tensor& w1, const torch::Tensor& w2,
                         const torch::Tensor& w3);
// The shared experts of a block (Qwen2-MoE, DeepSeek) on its normed input x [..., hidden], every
// token: one SwiGLU feed-forward layer of all of them together, times sigmoid(gate x) where the
// model gates it (Qwen2-MoE).
torch::Tensor shared_experts(const LayerWeights& w, const torch::Tensor& x);
// Experts on rows [n, hidden] grouped by expert (rows_per_expert of each, in order), each
// expert's weights given by `weights`: their outputs in the rows' order. Each group runs as one
// matrix multiply per weight, its rows padded to expert_row_multiple() where the CPU's 16-bit
// multiply wants few shapes.
struct ExpertWeights {
  torch::Tensor w1, w2, w3;
};
using ExpertWeightsFn = std::function<ExpertWeights(int64_t expert)>;
torch::Tensor grouped_experts(const torch::Tensor& rows, c10::IntArrayRef rows_per_expert, const ExpertWeightsFn& weights);
int64_t expert_row_multiple(const torch::Tensor& rows);

// The same experts in three grouped matrix multiplies (at::_grouped_mm; CUTLASS's grouped GEMM
// for bf16 on an H100) over the stacked weights w13 [experts, 2 x ffn, hidden] (w1 over w3) and
// w2 [experts, hidden, ffn]: `rows` [S, hidden] grouped by expert, `row_expert` [S] the expert of
// each row (ascending), on the rows' device. Every group is padded on the device to a multiple
// of 16 bytes of rows, at least one such (torchtitan's alignment for this kernel), so nothing is
// read back to the host.
torch::Tensor stacked_experts(const torch::Tensor& rows, const torch::Tensor& row_expert, const torch::Tensor& w13,
                              const torch::Tensor& w2);

// Which expert kernel a trainer runs: one matrix multiply per expert and weight (with the row
// counts on the host), or the grouped kernel over stacked weights. kAuto: grouped on a GPU in
// mixed precision (bf16 copies of fp32 master weights, which the stacks then are, so the
// memory is the same) when the hidden and expert widths are multiples of 16 bytes (the grouped
// kernel's alignment); per expert otherwise -- on the CPU, whose grouped kernel runs the same
// multiplies one group at a time, and where stacking would add a copy of the experts' weights.
enum class ExpertKernel { kAuto, kPerExpert, kGrouped };
ExpertKernel resolve_expert_kernel(ExpertKernel asked, const ModelSpec& spec, const torch::Device& device,
                                   torch::ScalarType master, torch::ScalarType compute);

// The experts' weights of every block with experts, stacked in `type` from the per-expert
// tensors (one per mixtral_parameters(spec), in its order): a leaf pair per block whose
// gradients add_gradients() hands back to the per-expert tensors.
class ExpertStacks {
 public:
  ExpertStacks(const ModelSpec& spec, const std::vector<torch::Tensor>& tensors, torch::ScalarType type);
  // Sets each block's experts_w13 and experts_w2.
  void bind(MixtralWeights& weights) const;
  // Adds each stack's gradient into grads (one per parameter, in mixtral_parameters order; an
  // undefined entry takes the gradient itself) and clears the stack's.
  void add_gradients(std::vector<torch::Tensor>& grads);
  // Whether parameter i is stacked (its gradient comes from add_gradients, not its own tensor).
  bool stacked(size_t i) const { return i < stacked_.size() && stacked_[i]; }

 private:
  struct Stack {
    int64_t block;
    torch::Tensor w13, w2;
    std::vector<size_t> w1_of, w2_of, w3_of;  // parameter index of each expert's w1, w2, w3
  };
  std::vector<Stack> stacks_;
  std::vector<bool> stacked_;
};

// Causal LM loss as Hugging Face computes it: logits[:, :-1] against input_ids[:, 1:].
LossTerms mixtral_loss(const ModelSpec& spec, const MoeConfig& moe, const ForwardResult& out,
                       const torch::Tensor& input_ids);
// The same with the lm term and each depth's multi-token prediction term computed elsewhere (a
// vocabulary-parallel cross entropy).
// With `over`, the router's losses are those of the tokens of every rank it sums over (routing.h).
LossTerms mixtral_loss_from_lm(const ModelSpec& spec, const MoeConfig& moe, const ForwardResult& out, torch::Tensor lm,
                               const std::vector<torch::Tensor>& mtp = {}, const RankSum& over = {});
// Next-token labels of input_ids [B, T]: input_ids[:, 1:], and kIgnoreLabel at the last position.
inline constexpr int64_t kIgnoreLabel = -100;
torch::Tensor next_token_labels(const torch::Tensor& input_ids);
// Multi-token prediction depth k (Megatron-Core rolls the sequence so): the input ids moved k
// to the left, zeros (token 0) in the last k places; and the labels of its positions, the token
// k + 1 ahead, kIgnoreLabel where there is none.
torch::Tensor mtp_input_ids(const torch::Tensor& input_ids, int64_t k);
torch::Tensor mtp_labels(const torch::Tensor& input_ids, int64_t k);

}  // namespace moeplan::executor
