#include <cstdio>
#include <filesystem>

#include "measure.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/run_measurement.h"

namespace moeplan::executor::calibration {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int repeats_for(int reps, double one_call_s) {
  const double wanted = 0.1 / std::max(one_call_s, 1e-6);
  return std::clamp(static_cast<int>(wanted), reps, 60);
}

double median_of(const torch::Tensor& t) {
  const torch::Tensor flat = t.to(torch::kDouble).contiguous().flatten();
  return median(std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel()));
}

void Progress::say(const std::string& what) {
  if (out_ == nullptr) return;
  char line[256];
  std::snprintf(line, sizeof line, "calibrate [%5.1f s] %s", seconds_since(start_), what.c_str());
  *out_ << line << std::endl;
}

void OverheadProbe::sample() {
  if (stopped_ || !device_.is_cuda()) return;
  const DeviceMemory d = device_memory(device_);
  most_ = std::max(most_, d.used - d.reserved);
}

std::vector<int64_t> micro_batches(int64_t max_micro_batch) {
  std::vector<int64_t> m;
  for (int64_t b = 1; b <= max_micro_batch; b *= 2) m.push_back(b);
  return m;
}

Plan alone_plan(const CalibrateOptions& o) {
  Plan p;
  p.model = o.model;
  p.training.seq_len = o.seq_len;
  p.training.precision = o.precision;
  p.moe.load_balancing = o.load_balancing;
  return p;
}

Workload::Workload(const CalibrateOptions& options, Communicator& communicator, const MeshMaker& meshes)
    : device(options.device), o(options), world(communicator), m(options.model), type(compute_type(options.precision)),
      master(options.precision == Precision::kBf16 ? torch::kBFloat16 : torch::kFloat), h(m.hidden_size),
      t(options.seq_len), n(communicator.size()), a(options.precision == Precision::kFp32 ? 4 : 2),
      reps(options.quick ? 3 : 7), few(options.quick ? 2 : 1), mbs(micro_batches(options.max_micro_batch)),
      rope(rope_tables(m, t, type, device)), mask(attention_mask_bias(m, t, type, device)),
      whole_plan(alone_plan(options)), alone(whole_plan.parallel),
      store((o.scratch_dir.empty() ? std::filesystem::temp_directory_path().string() : o.scratch_dir) +
            "/.calibrate-offload-rank-" + std::to_string(communicator.rank())),
      mesh_of(meshes) {
  for (int64_t r = 16; r <= m.experts_per_token * t * o.max_micro_batch; r *= o.quick ? 4 : 2) expert_rows.push_back(r);
  // Every power-of-two split of this node's ranks the executor can run (the shapes its rule
  // executor_tensor_splits and the heads' split ask to divide).
  for (int64_t split = 2; split <= n; split *= 2)
    if (m.num_attention_heads % split == 0 && m.num_key_value_heads % split == 0 && m.intermediate_size % split == 0 &&
        m.vocab_size % split == 0 && t % split == 0)
      splits.push_back(split);
  for (int64_t b : mbs) {
    gemms.push_back({b * t, h, m.num_attention_heads * m.head_dim});  // q projection
    gemms.push_back({b * t, h, m.vocab_size});                        // lm head
  }
  for (int64_t r : expert_rows) {
    gemms.push_back({r, h, m.intermediate_size});  // w1, w3
    gemms.push_back({r, m.intermediate_size, h});  // w2
  }
  // The optimizer's shards of the model's flat units: the whole model, then halves, quarters,
  // ... as sharding leaves them.
  const ParamCounts params = count_parameters(m);
  units = {params.embedding, params.final_norm + params.lm_head};
  for (int64_t l = 0; l < m.num_layers; ++l) {
    units.push_back(params.dense_per_layer());
    units.push_back(m.num_experts * params.expert);
  }
  divisors = o.quick ? std::vector<int64_t>{2, 1} : std::vector<int64_t>{8, 4, 2, 1};
  for (int64_t d : divisors) {
    int64_t total = 0;
    for (int64_t numel : units) total += (numel + d - 1) / d;
    shard_sizes.push_back(total);
  }
  // Collectives: a sweep of sizes, and the model's flat units as the executor moves them:
  // gathered and reduce-scattered over a shard group of every rank (padded to a multiple of
  // it), all-reduced whole over a replica group of every rank.
  for (int64_t b = int64_t{16} << 10; b <= (o.quick ? int64_t{4} << 20 : int64_t{16} << 20); b *= 2) {
    sizes.push_back(b);
    if (b >= (int64_t{1} << 20) && !o.quick) sizes.push_back(b * 3 / 2);
  }
  auto padded = [&](int64_t numel, int64_t s) { return (numel + s - 1) / s * s * a; };
  for (const int64_t numel : {params.dense_per_layer(), m.num_experts * params.expert, params.embedding,
                              params.final_norm + params.lm_head}) {
    for (const char* kind : {"all_gather", "reduce_scatter"}) unit_sizes[kind].push_back(padded(numel, n));
    unit_sizes["all_reduce"].push_back(padded(numel, 1));
  }
  for (auto& [kind, list] : unit_sizes) {
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
  }
  moe.load_balancing = o.load_balancing;
  if (device.is_cpu()) {
    whole = std::make_unique<ShardedModel>(whole_plan, alone);
    recomputed_plan = whole_plan;
    recomputed_plan.parallel.activation_checkpointing = Checkpointing::kFull;
    recomputed = std::make_unique<ShardedModel>(recomputed_plan, alone);
  } else {
    trainer = std::make_unique<ModelTrainer>(whole_plan, device);
  }
  w.input_norm = torch::ones({h}).to(device, type).requires_grad_(true);
  w.post_attention_norm = torch::ones({h}).to(device, type).requires_grad_(true);
  set_attention_weights(w, m);
  if (m.qk_norm) {
    w.q_norm = torch::ones({m.head_dim}).to(device, type).requires_grad_(true);
    w.k_norm = torch::ones({m.head_dim}).to(device, type).requires_grad_(true);
  }
  w.router = weight({m.num_experts, h});
  w1 = weight({m.intermediate_size, h});
  w2 = weight({h, m.intermediate_size});
  w3 = weight({m.intermediate_size, h});
  embed = weight({m.vocab_size, h});
  norm = torch::ones({h}).to(device, type).requires_grad_(true);
  lm_head = weight({m.vocab_size, h});
  token = torch::zeros({1});
  expert_counts = torch::zeros({1, m.num_experts}, torch::kLong);
  const int64_t dispatch_rows = m.experts_per_token * t / n * n;
  dispatch = torch::randn({dispatch_rows, h}).to(a == 4 ? torch::kFloat : torch::kBFloat16);
  dispatch_split.assign(static_cast<size_t>(n), dispatch_rows / n);
  after_collectives = {{"all_reduce", [this] { world.all_reduce_sum(token); }},
                       {"all_gather", [this] { (void)world.all_gather(expert_counts); }},
                       {"all_to_all", [this] { (void)world.all_to_all(dispatch, dispatch_split, dispatch_split); }}};
  stretch_x = torch::randn({1, t, h}).to(type);
  stretch_ids = torch::randint(m.vocab_size, {1, t}, torch::kLong);
  stretches = {
      {[this] { (void)torch::matmul(stretch_x, w.router.t()).softmax(-1).topk(m.experts_per_token); }, 80 / few},
      {[this] { (void)attention(m, w, rms_norm(stretch_x, w.input_norm, m.rms_norm_eps), rope, mask); }, 40 / few},
      {[this] { (void)micro_batch_loss(stretch_ids); }, 24 / few},
      {[this] { micro_batch_loss(stretch_ids).backward(); }, 16 / few}};
}

void Workload::set_attention_weights(LayerWeights& into, const ModelSpec& local) const {
  const int64_t heads = local.num_attention_heads;
  if (!local.mla()) {
    into.q_proj = weight({heads * local.head_dim, h});
    into.k_proj = weight({local.num_key_value_heads * local.head_dim, h});
    into.v_proj = weight({local.num_key_value_heads * local.head_dim, h});
    into.o_proj = weight({h, heads * local.head_dim});
    return;
  }
  // DeepSeek's latent attention (mixtral.h): the down projections and latent norms whole, the
  // up projections and o_proj by heads.
  const int64_t nope = local.head_dim - local.qk_rope_head_dim;
  if (local.q_lora_rank > 0) {
    into.q_a_proj = weight({local.q_lora_rank, h});
    into.q_a_norm = torch::ones({local.q_lora_rank}).to(device, type).requires_grad_(true);
    into.q_b_proj = weight({heads * local.head_dim, local.q_lora_rank});
  } else {
    into.q_proj = weight({heads * local.head_dim, h});
  }
  into.kv_a_proj = weight({local.kv_lora_rank + local.qk_rope_head_dim, h});
  into.kv_a_norm = torch::ones({local.kv_lora_rank}).to(device, type).requires_grad_(true);
  into.kv_b_proj = weight({heads * (nope + local.v_head_dim), local.kv_lora_rank});
  into.o_proj = weight({h, heads * local.v_head_dim});
}

torch::Tensor Workload::micro_batch_loss(const torch::Tensor& ids, bool recompute) {
  ShardedModel* model = recompute ? recomputed.get() : whole.get();
  if (!model) throw std::logic_error("calibration: the sharded model is measured on CPU ranks only");
  return model->loss(model->forward(ids, 1), ids).total;
}

void Workload::form_split_models() {
  // The model on a mesh of the ranks, the time inside `group`'s collectives counted apart.
  auto form = [&](const ParallelConfig& parallel, Communicator DeviceMesh::*group) {
    auto s = std::make_unique<SplitModel>();
    s->plan = alone_plan(o);
    s->plan.parallel = parallel;
    s->mesh = mesh_of(s->plan.parallel);
    s->model = std::make_unique<ShardedModel>(s->plan, *s->mesh);
    ((*s->mesh).*group)
        .set_observer([inside = &s->inside_s](const char*, int64_t, Clock::time_point start, Clock::time_point end) {
          *inside += std::chrono::duration<double>(end - start).count();
        });
    split_models.push_back(std::move(s));
  };
  for (int64_t split : splits) {
    if (n % split != 0) continue;
    ParallelConfig p = alone_plan(o).parallel;
    p.world_size = n;
    p.tensor_parallel_degree = split;
    p.sequence_parallel = true;
    form(p, &DeviceMesh::tensor);
  }
  // The routed experts over E ranks (the rest replicas), as an expert-parallel layout runs
  // them: its dispatch and combine and what they take beyond the exchanges.
  for (int64_t e = 2; e <= n && !m.dense(); e *= 2) {
    if (n % e != 0 || m.num_experts % e != 0) continue;
    ParallelConfig p = alone_plan(o).parallel;
    p.world_size = n;
    p.expert_parallel_degree = e;
    form(p, &DeviceMesh::expert);
  }
  // The states sharded over every rank (S = n), as a sharded layout runs them: every unit
  // gathered (the next block's while this one computes) and its gradient reduce-scattered, on
  // the processors the compute runs on.
  if (n > 1) {
    ParallelConfig p = alone_plan(o).parallel;
    p.world_size = n;
    p.hybrid_shard_degree = n;
    form(p, &DeviceMesh::shard);
  }
}

torch::Tensor Workload::weight(std::vector<int64_t> shape) const {
  return (torch::randn(shape) * 0.02).to(device, type).requires_grad_(true);
}

}  // namespace moeplan::executor::calibration
