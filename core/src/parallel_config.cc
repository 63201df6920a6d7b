#include "moeplan/core/parallel_config.h"

#include <algorithm>
#include <vector>

namespace moeplan {

namespace {
constexpr int64_t kMaxDegree = int64_t{1} << 20;
constexpr int64_t kMaxBatch = int64_t{1} << 16;
constexpr int64_t kMaxTokens = int64_t{1} << 50;

char letter(MeshDim d) {
  switch (d) {
    case MeshDim::kReplica: return 'R';
    case MeshDim::kShard: return 'S';
    case MeshDim::kExpert: return 'E';
    case MeshDim::kTensor: return 'T';
    case MeshDim::kPipeline: return 'P';
    case MeshDim::kContext: return 'C';
  }
  return '?';
}
}  // namespace

std::string Placement::to_string() const {
  const bool short_form = outer_to_inner.front() == MeshDim::kPipeline && outer_to_inner.back() == MeshDim::kTensor;
  std::string s;
  for (MeshDim d : outer_to_inner)
    if (!short_form || (d != MeshDim::kPipeline && d != MeshDim::kTensor)) s += letter(d);
  return s;
}

std::optional<Placement> Placement::parse(std::string_view text) {
  // SMP v1's names (its docs: "spread" is "TPD", "cluster" is "DPT").
  if (text == "cluster") text = "DPT";
  else if (text == "spread") text = "TPD";
  std::vector<MeshDim> dims;
  for (char c : text) {
    switch (c) {
      case 'R': dims.push_back(MeshDim::kReplica); break;
      case 'S': dims.push_back(MeshDim::kShard); break;
      case 'E': dims.push_back(MeshDim::kExpert); break;
      case 'T': dims.push_back(MeshDim::kTensor); break;
      case 'P': dims.push_back(MeshDim::kPipeline); break;
      case 'D': dims.insert(dims.end(), {MeshDim::kReplica, MeshDim::kShard, MeshDim::kExpert}); break;
      default: return std::nullopt;
    }
    if (dims.size() > kPlacedDims) return std::nullopt;
  }
  std::array<int, kMeshDims> seen{};
  for (MeshDim d : dims) ++seen[static_cast<size_t>(d)];
  for (MeshDim d : kAllMeshDims) {
    if (d == MeshDim::kContext) continue;  // not placed: directly outside T
    const bool optional = d == MeshDim::kTensor || d == MeshDim::kPipeline;
    if (seen[static_cast<size_t>(d)] > 1 || (!optional && seen[static_cast<size_t>(d)] == 0)) return std::nullopt;
  }
  if (seen[static_cast<size_t>(MeshDim::kPipeline)] == 0) dims.insert(dims.begin(), MeshDim::kPipeline);
  if (seen[static_cast<size_t>(MeshDim::kTensor)] == 0) dims.push_back(MeshDim::kTensor);
  Placement p;
  std::copy(dims.begin(), dims.end(), p.outer_to_inner.begin());
  return p;
}

int64_t ParallelConfig::stride(MeshDim d) const {
  if (d == MeshDim::kContext) return stride(MeshDim::kTensor) * tensor_parallel_degree;
  int64_t s = 1;
  for (size_t i = kPlacedDims; i-- > 0;) {
    const MeshDim here = placement.outer_to_inner[i];
    if (here == d) return s;
    s *= degree(here);
    if (here == MeshDim::kTensor) s *= context_parallel_degree;  // C directly outside T
  }
  return s;
}

static void read_parallel_fields(ObjectReader& r, ParallelConfig& p) {
  Diagnostics& d = r.diagnostics();
  const size_t problems_before = d.items().size();
  p.world_size = r.integer("world_size", 1, kMaxDegree);
  p.expert_parallel_degree = r.integer("expert_parallel_degree", 1, kMaxDegree);
  p.hybrid_shard_degree = r.integer("hybrid_shard_degree", 0, kMaxDegree);
  p.tensor_parallel_degree = r.integer("tensor_parallel_degree", 1, kMaxDegree, 1);
  p.expert_tensor_parallel_degree = r.integer("expert_tensor_parallel_degree", 0, kMaxDegree, 0);
  if (p.expert_tensor_parallel_degree == p.tensor_parallel_degree) p.expert_tensor_parallel_degree = 0;  // one form
  p.pipeline_parallel_degree = r.integer("pipeline_parallel_degree", 1, kMaxDegree, 1);
  p.context_parallel_degree = r.integer("context_parallel_degree", 1, kMaxDegree, 1);
  p.context_exchange = r.choice<ContextExchange>("context_exchange", kContextExchangeNames, ContextExchange::kRing);
  p.dense_shard_spans_experts = r.boolean("dense_shard_spans_experts", false);
  p.virtual_pipeline_degree = r.integer("virtual_pipeline_degree", 1, kMaxDegree, 1);
  p.sequence_parallel = r.boolean("sequence_parallel", false);
  const bool degrees_read = d.items().size() == problems_before;
  const std::string placement = r.string("placement", "RSE");
  if (auto parsed = Placement::parse(placement)) {
    p.placement = *parsed;
  } else {
    d.error(r.path_of("placement"),
            "expected the letters R, S and E once each and P and T at most once, outermost first "
            "(e.g. \"RSE\" or \"PRSET\"; \"D\" stands for \"RSE\"; or SMP's \"cluster\" or "
            "\"spread\"), got \"" +
                placement.substr(0, 16) + "\"");
  }
  p.activation_checkpointing = r.choice<Checkpointing>("activation_checkpointing", kCheckpointingNames);
  p.activation_offloading = r.boolean("activation_offloading", false);
  p.activation_loading_horizon = r.integer("activation_loading_horizon", 0, kMaxDegree, 1);
  p.micro_batch_size = r.integer("micro_batch_size", 1, kMaxBatch);
  p.gradient_accumulation_steps = r.integer("gradient_accumulation_steps", 1, kMaxBatch);
  p.distributed_optimizer = r.boolean("distributed_optimizer", false);
  p.first_stage_layers = r.integer("first_stage_layers", 0, kMaxDegree, 0);
  p.last_stage_layers = r.integer("last_stage_layers", 0, kMaxDegree, 0);
  // replica_degree is derived; a plan writes it for readers, and it must agree.
  // (Only when the degrees themselves were read: a fallback would make it look wrong.)
  if (r.has("replica_degree")) {
    const int64_t written = r.integer("replica_degree", 1, kMaxDegree);
    const int64_t rest = p.expert_data_degree() * p.hybrid_shard_degree * p.tensor_parallel_degree *
                         p.pipeline_parallel_degree * p.context_parallel_degree;
    // (Nor where the folded ranks do not divide E: rule expert_tensor_folds says that.)
    if (degrees_read && rest > 0 && p.expert_parallel_degree % p.expert_fold() == 0 && p.world_size % rest == 0 &&
        written != p.world_size / rest)
      d.error(r.path_of("replica_degree"),
              std::to_string(written) + " does not equal world_size / (expert_parallel_degree" +
                  (p.expert_fold() > 1 ? " / " + std::to_string(p.expert_fold()) + " folded ranks" : std::string()) +
                  " * hybrid_shard_degree" +
                  (p.tensor_parallel_degree != 1 ? " * tensor_parallel_degree" : "") +
                  (p.context_parallel_degree != 1 ? " * context_parallel_degree" : "") +
                  (p.pipeline_parallel_degree != 1 ? " * pipeline_parallel_degree" : "") +
                  ") = " + std::to_string(p.world_size / rest));
  }
}

ParallelConfig read_parallel(const Json& json, const std::string& path, Diagnostics& d) {
  return read_object<ParallelConfig>(json, path, d, read_parallel_fields);
}

static void read_moe_fields(ObjectReader& r, MoeConfig& m) {
  Diagnostics& d = r.diagnostics();
  m.load_balancing = r.choice<LoadBalancing>("load_balancing", kLoadBalancingNames, LoadBalancing::kSinkhorn);
  m.dispatcher = r.choice<Dispatcher>("dispatcher", kDispatcherNames, Dispatcher::kAllToAll);
  m.overlap_exchange = r.boolean("overlap_exchange", false);
  m.overlap_shared_expert = r.boolean("overlap_shared_expert", false);
  m.global_token_shuffle = r.boolean("global_token_shuffle", false);
  m.capacity_factor = r.number("capacity_factor", 0.0, 1e6, 0.0);
  m.drop_policy = r.choice<TokenDropPolicy>("drop_policy", kTokenDropPolicyNames, TokenDropPolicy::kProbs);
  m.pad_to_capacity = r.boolean("pad_to_capacity", false);
  m.aux_loss_coef = r.number("aux_loss_coef", 0.0, 1e3, 0.001);
  m.z_loss_coef = r.number("z_loss_coef", 0.0, 1e3, 0.0);
  m.expert_load_imbalance = r.number("expert_load_imbalance", 1.0, 1e6, 1.0);
  m.random_seed = r.integer("random_seed", 0, INT64_MAX, 12345);
  if (const Json* counts = r.child("tokens_per_expert", true)) {
    const std::string at = r.path_of("tokens_per_expert");
    if (!counts->is_array() || counts->size() > 4096) {
      d.error(at, "expected an array of at most 4096 counts, got " + describe_json(*counts));
    } else {
      for (size_t i = 0; i < counts->size(); ++i) {
        const Json& c = (*counts)[i];
        if (!c.is_number() || !(c.get<double>() >= 0.0 && c.get<double>() <= 1e18)) {
          d.error(at + "[" + std::to_string(i) + "]", "expected a count in [0, 1e18], got " + describe_json(c));
          continue;
        }
        m.tokens_per_expert.push_back(c.get<double>());
      }
    }
  }
}

MoeConfig read_moe(const Json& json, const std::string& path, Diagnostics& d) {
  return read_object<MoeConfig>(json, path, d, read_moe_fields);
}

static void read_training_fields(ObjectReader& r, TrainingConfig& t) {
  t.seq_len = r.integer("seq_len", 1, int64_t{1} << 24);
  t.global_batch_tokens = r.integer("global_batch_tokens", 1, kMaxTokens);
  t.precision = r.choice<Precision>("precision", kPrecisionNames, Precision::kBf16);
  t.fp8 = r.boolean("fp8", false);
  t.fp32_gradients = r.boolean("fp32_gradients", true);
  t.steps = r.integer("steps", 1, int64_t{1} << 40, 100);
  t.learning_rate = r.number("learning_rate", 0.0, 10.0, 1e-4);
  t.min_learning_rate = r.number("min_learning_rate", 0.0, 10.0, 1e-5);
  t.warmup_steps = r.integer("warmup_steps", 0, int64_t{1} << 40, 10);
  t.weight_decay = r.number("weight_decay", 0.0, 10.0, 0.1);
  t.adam_beta1 = r.number("adam_beta1", 0.0, 1.0, 0.9);
  t.adam_beta2 = r.number("adam_beta2", 0.0, 1.0, 0.95);
  t.max_grad_norm = r.number("max_grad_norm", 0.0, 1e9, 1.0);
  t.seed = r.integer("seed", 0, INT64_MAX, 12345);
  t.data = r.string("data", "");
}

TrainingConfig read_training(const Json& json, const std::string& path, Diagnostics& d) {
  return read_object<TrainingConfig>(json, path, d, read_training_fields);
}

Json to_json(const ParallelConfig& p) {
  Json j;
  j["world_size"] = p.world_size;
  j["expert_parallel_degree"] = p.expert_parallel_degree;
  j["hybrid_shard_degree"] = p.hybrid_shard_degree;
  j["replica_degree"] = p.replica_degree();
  j["tensor_parallel_degree"] = p.tensor_parallel_degree;
  if (p.expert_tensor_parallel_degree > 0 && p.expert_tensor_parallel_degree != p.tensor_parallel_degree)
    j["expert_tensor_parallel_degree"] = p.expert_tensor_parallel_degree;
  j["pipeline_parallel_degree"] = p.pipeline_parallel_degree;
  if (p.context_parallel_degree > 1) {
    j["context_parallel_degree"] = p.context_parallel_degree;
    j["context_exchange"] = name_of(kContextExchangeNames, p.context_exchange);
  }
  if (p.dense_shard_spans_experts) j["dense_shard_spans_experts"] = true;
  j["virtual_pipeline_degree"] = p.virtual_pipeline_degree;
  j["sequence_parallel"] = p.sequence_parallel;
  j["placement"] = p.placement.to_string();
  j["activation_checkpointing"] = name_of(kCheckpointingNames, p.activation_checkpointing);
  j["activation_offloading"] = p.activation_offloading;
  j["activation_loading_horizon"] = p.activation_loading_horizon;
  j["micro_batch_size"] = p.micro_batch_size;
  j["gradient_accumulation_steps"] = p.gradient_accumulation_steps;
  if (p.distributed_optimizer) j["distributed_optimizer"] = true;
  if (p.first_stage_layers > 0) j["first_stage_layers"] = p.first_stage_layers;
  if (p.last_stage_layers > 0) j["last_stage_layers"] = p.last_stage_layers;
  return j;
}

Json to_json(const MoeConfig& m) {
  Json j;
  j["load_balancing"] = name_of(kLoadBalancingNames, m.load_balancing);
  j["dispatcher"] = name_of(kDispatcherNames, m.dispatcher);
  if (m.overlap_exchange) j["overlap_exchange"] = true;
  if (m.overlap_shared_expert) j["overlap_shared_expert"] = true;
  j["global_token_shuffle"] = m.global_token_shuffle;
  if (m.capacity_factor > 0) {
    j["capacity_factor"] = m.capacity_factor;
    j["drop_policy"] = name_of(kTokenDropPolicyNames, m.drop_policy);
    if (m.pad_to_capacity) j["pad_to_capacity"] = true;
  }
  j["aux_loss_coef"] = m.aux_loss_coef;
  j["z_loss_coef"] = m.z_loss_coef;
  j["expert_load_imbalance"] = m.expert_load_imbalance;
  j["random_seed"] = m.random_seed;
  if (!m.tokens_per_expert.empty()) j["tokens_per_expert"] = m.tokens_per_expert;
  return j;
}

Json to_json(const TrainingConfig& t) {
  Json j;
  j["seq_len"] = t.seq_len;
  j["global_batch_tokens"] = t.global_batch_tokens;
  j["precision"] = name_of(kPrecisionNames, t.precision);
  if (t.fp8) j["fp8"] = true;
  if (!t.fp32_gradients) j["fp32_gradients"] = false;
  j["steps"] = t.steps;
  j["learning_rate"] = t.learning_rate;
  j["min_learning_rate"] = t.min_learning_rate;
  j["warmup_steps"] = t.warmup_steps;
  j["weight_decay"] = t.weight_decay;
  j["adam_beta1"] = t.adam_beta1;
  j["adam_beta2"] = t.adam_beta2;
  j["max_grad_norm"] = t.max_grad_norm;
  j["seed"] = t.seed;
  if (!t.data.empty()) j["data"] = t.data;
  return j;
}

namespace {
// Stages that take the evenly split rest of the blocks, and that rest.
std::pair<int64_t, int64_t> middle_stages(int64_t num_layers, const ParallelConfig& p) {
  const int64_t stages = std::max<int64_t>(1, p.pipeline_parallel_degree);
  int64_t middle = stages, rest = num_layers;
  if (stages > 1 && p.first_stage_layers > 0) {
    --middle;
    rest -= p.first_stage_layers;
  }
  if (stages > 1 && p.last_stage_layers > 0) {
    --middle;
    rest -= p.last_stage_layers;
  }
  return {middle, rest};
}
}  // namespace

bool stage_layers_valid(int64_t num_layers, const ParallelConfig& p) {
  if (p.pipeline_parallel_degree <= 1) return p.first_stage_layers == 0 && p.last_stage_layers == 0;
  const auto [middle, rest] = middle_stages(num_layers, p);
  return middle == 0 ? rest == 0 : rest >= middle && rest % middle == 0;
}

int64_t stage_layers(int64_t num_layers, const ParallelConfig& p, int64_t stage) {
  const int64_t stages = std::max<int64_t>(1, p.pipeline_parallel_degree);
  if (stages == 1) return num_layers;
  if (stage == 0 && p.first_stage_layers > 0) return p.first_stage_layers;
  if (stage == stages - 1 && p.last_stage_layers > 0) return p.last_stage_layers;
  const auto [middle, rest] = middle_stages(num_layers, p);
  return middle > 0 ? rest / middle : 0;
}

namespace {
// The decoder's blocks on a stage (no multi-token prediction blocks).
StageBlockCounts decoder_block_counts(const ModelSpec& model, const ParallelConfig& p, int64_t stage) {
  const int64_t stages = std::max<int64_t>(1, p.pipeline_parallel_degree);
  const int64_t chunks = std::max<int64_t>(1, p.virtual_pipeline_degree);
  const bool uneven = p.first_stage_layers > 0 || p.last_stage_layers > 0;
  const bool interleaved = stages > 1 && chunks > 1 && !uneven;
  const int64_t chunk = interleaved ? model.num_layers / (stages * chunks) : 0;
  StageBlockCounts out;
  out.layers = interleaved ? chunk * chunks : stage_layers(model.num_layers, p, stage);
  if (model.first_dense_layers == 0 && model.moe_layer_step == 1) {  // every block has experts
    out.moe_layers = out.layers;
    return out;
  }
  if (interleaved) {
    for (int64_t v = 0; v < chunks; ++v) {
      const int64_t begin = (v * stages + stage) * chunk;
      out.moe_layers += model.moe_layers_in(begin, begin + chunk);
    }
    return out;
  }
  // The stages before it: the first (its own size where given), then middle ones.
  int64_t begin = 0;
  if (stage > 0) {
    const int64_t middle = stage_layers(model.num_layers, p, std::min<int64_t>(1, stages - 1));
    begin = stage_layers(model.num_layers, p, 0) + (stage - 1) * middle;
  }
  out.moe_layers = model.moe_layers_in(begin, begin + out.layers);
  return out;
}

bool last_stage(const ParallelConfig& p, int64_t stage) {
  return stage == std::max<int64_t>(1, p.pipeline_parallel_degree) - 1;
}
}  // namespace

StageBlockCounts stage_block_counts(const ModelSpec& model, const ParallelConfig& p, int64_t stage) {
  StageBlockCounts out = decoder_block_counts(model, p, stage);
  if (last_stage(p, stage)) {  // multi-token prediction blocks (MoE blocks, rule moe_layer_pattern)
    out.layers += model.mtp_layers;
    out.moe_layers += model.mtp_layers;
  }
  return out;
}

ModelSpec stage_blocks(const ModelSpec& model, const ParallelConfig& p, int64_t stage) {
  const StageBlockCounts counts = decoder_block_counts(model, p, stage);
  ModelSpec m = model;
  m.num_layers = counts.layers;
  if (!last_stage(p, stage)) m.mtp_layers = 0;
  if (model.dense()) return m;
  m.first_dense_layers = counts.layers - counts.moe_layers;
  m.moe_layer_step = 1;
  m.moe_layer_offset = 0;
  return m;
}

std::string describe(const ParallelConfig& p) {
  std::string s = "E" + std::to_string(p.expert_parallel_degree) + " S" + std::to_string(p.hybrid_shard_degree) +
                  (p.dense_shard_spanning() ? " dense-S" + std::to_string(p.dense_shard_degree()) : "") + " R" +
                  std::to_string(p.replica_degree());
  if (p.tensor_parallel_degree > 1) s += " T" + std::to_string(p.tensor_parallel_degree) + (p.sequence_parallel ? " sp" : "");
  if (p.expert_tensor_degree() != std::max<int64_t>(1, p.tensor_parallel_degree))
    s += " ETP" + std::to_string(p.expert_tensor_degree());
  if (p.pipeline_parallel_degree > 1) s += " P" + std::to_string(p.pipeline_parallel_degree);
  if (p.context_parallel_degree > 1)
    s += " C" + std::to_string(p.context_parallel_degree) +
         (p.context_exchange == ContextExchange::kAllGather ? " all_gather" : "");
  if (p.virtual_pipeline_degree > 1) s += " V" + std::to_string(p.virtual_pipeline_degree);
  s += " " + p.placement.to_string() + " ckpt=" + std::string(name_of(kCheckpointingNames, p.activation_checkpointing));
  if (p.activation_offloading) s += " offload=h" + std::to_string(p.activation_loading_horizon);
  if (p.distributed_optimizer) s += " dist-opt";
  if (p.first_stage_layers > 0 || p.last_stage_layers > 0)
    s += " ends=" + std::to_string(p.first_stage_layers) + "/" + std::to_string(p.last_stage_layers);
  s += " mbs=" + std::to_string(p.micro_batch_size) + " ga=" + std::to_string(p.gradient_accumulation_steps);
  return s;
}

}  // namespace moeplan
