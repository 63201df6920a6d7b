#include "moeplan/planner/search.h"

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

#include "moeplan/core/moe_load.h"
#include "moeplan/core/routing_profile.h"
#include "moeplan/core/units.h"
#include "moeplan/frameworks/framework.h"
#include "moeplan/simulator/routing.h"
#include "moeplan/simulator/step.h"

namespace moeplan::planner {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d * d <= n; ++d) {
    if (n % d != 0) continue;
    out.push_back(d);
    if (d != n / d) out.push_back(n / d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

constexpr std::array<const char*, 6> kPlacements = {"RSE", "RES", "SRE", "SER", "ERS", "ESR"};

bool better(const Candidate& a, const Candidate& b) {
  if (a.estimate.tokens_per_s != b.estimate.tokens_per_s)
    return a.estimate.tokens_per_s > b.estimate.tokens_per_s;
  if (a.memory.device_total != b.memory.device_total) return a.memory.device_total < b.memory.device_total;
  return a.index < b.index;
}

// A candidate that differs from a better-ranked one only in its loading horizon, at the same
// predicted speed, just holds more memory: it is not worth showing.
bool horizon_duplicate(const Candidate& c, const std::vector<Candidate>& ranked) {
  return std::any_of(ranked.begin(), ranked.end(), [&](const Candidate& r) {
    ParallelConfig same_horizon = c.parallel;
    same_horizon.activation_loading_horizon = r.parallel.activation_loading_horizon;
    return same_horizon == r.parallel && r.estimate.tokens_per_s == c.estimate.tokens_per_s;
  });
}

// Simulates candidates in `order` (the analytic estimate's best first, so that the bound
// tightens early), skipping those that can no longer enter the top `keep` (their lower bound
// is above the keep-th best simulated time).
std::vector<Candidate> simulate_best(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
                                     const std::vector<Candidate>& fitting, const std::vector<uint32_t>& order,
                                     SearchStats& stats) {
  std::vector<Candidate> simulated;
  std::vector<double> best_times;  // ascending, at most `keep`
  for (uint32_t i : order) {
    const Candidate& c = fitting[i];
    // The bound is in double, the simulation rounds each op to a nanosecond: leave a margin.
    if (options.prune && best_times.size() >= options.keep && c.estimate.lower_bound_s > best_times.back() * (1 + 1e-6))
      continue;
    if (options.prune && stats.simulated >= options.max_simulated) {
      ++stats.unsimulated;
      continue;
    }
    const RunConfig config{model, cluster, c.parallel, options.moe, options.training};
    Candidate s = c;
    s.estimate = sim::simulate_step(config).estimate;
    s.simulated = true;
    ++stats.simulated;
    if (horizon_duplicate(s, simulated)) continue;
    best_times.insert(std::upper_bound(best_times.begin(), best_times.end(), s.estimate.step_time_s),
                      s.estimate.step_time_s);
    if (best_times.size() > options.keep) best_times.pop_back();
    simulated.push_back(s);
  }
  return simulated;
}

}  // namespace

ClusterSpec size_cluster(ClusterSpec profile, int64_t gpus) {
  profile.num_nodes = std::max<int64_t>(1, (gpus + profile.gpus_per_node - 1) / profile.gpus_per_node);
  return profile;
}

int64_t default_global_batch_tokens(int64_t gpus, int64_t seq_len) {
  constexpr int64_t kTarget = int64_t{4} << 20;
  const int64_t unit = gpus * seq_len;
  return (kTarget + unit - 1) / unit * unit;
}

namespace {

// Every order of the five mesh dimensions: each order of R, S and E (as SMP v2 writes them),
// with T first innermost and P first outermost, so that with T = P = 1 the first six are the
// three-letter placements.
std::vector<Placement> all_placements() {
  std::vector<Placement> out;
  for (const char* rse : kPlacements) {
    const Placement base = *Placement::parse(rse);  // P outermost, T innermost
    std::array<MeshDim, 3> middle{base.outer_to_inner[1], base.outer_to_inner[2], base.outer_to_inner[3]};
    for (size_t t = 4; t-- > 0;) {      // T's position among R, S, E: innermost first
      for (size_t pp = 0; pp < 5; ++pp) {  // P's position in the result: outermost first
        std::vector<MeshDim> order(middle.begin(), middle.end());
        order.insert(order.begin() + static_cast<std::ptrdiff_t>(t), MeshDim::kTensor);
        order.insert(order.begin() + static_cast<std::ptrdiff_t>(pp), MeshDim::kPipeline);
        Placement p;
        std::copy(order.begin(), order.end(), p.outer_to_inner.begin());
        out.push_back(p);
      }
    }
  }
  return out;
}

}  // namespace

namespace {

struct OffloadOption {
  bool on;
  int64_t horizon;
};

// Choices made per (E, S, T, P) beside checkpointing, offloading and the micro-batch.
struct Variant {
  int64_t chunks;
  bool sequence, distributed_optimizer, dense_shard_spans_experts;
  std::pair<int64_t, int64_t> ends;
};

// The raw space: degrees that divide the world size or the expert count (the rules reject the
// ones that do not fit both), tensor parallelism inside a node (its all-reduces are on every
// block's critical path; Megatron keeps T within NVLink), pipelines of up to one block per
// stage, sequence parallelism with T, every placement, every checkpointing and offload option,
// power-of-two micro-batches and the divisors of the per-reader batch. What the user fixed:
// the one value, even where the search would not have tried it (the rules then say why it
// cannot work).
struct Space {
  Space(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options);

  // Pipeline splits: equal stages, or where P does not divide the blocks, end stages a block
  // or two lighter than the others (they also hold the embedding and the head; Llama 3 405B
  // runs 126 blocks on 16 stages as 7, 14 x 8 and 7).
  std::vector<std::pair<int64_t, int64_t>> stage_splits(int64_t pp) const;
  // The sequences each data reader takes per step with T, P and C (the ranks that read data
  // are W / (C T P)).
  int64_t seqs_per_reader(int64_t t, int64_t pp, int64_t cp) const;
  // Micro-batch sizes for T, P and C: powers of two and the divisors of the per-reader batch.
  std::vector<int64_t> micro_batches(int64_t t, int64_t pp, int64_t cp) const;
  std::vector<Variant> variants(int64_t e, int64_t s, int64_t t, int64_t pp, int64_t cp) const;
  // Whether the dense shard spans the expert (the mesh's E) and context ranks: what the framework
  // does, where there are some.
  std::vector<bool> dense_shard_span_options(int64_t e, int64_t cp) const;
  // The degrees chosen with T: each pipeline degree, each split of the routed experts under T
  // (T as 0, and where the framework folds the tensor ranks into the expert group, 1) and each
  // context-parallel degree.
  struct InnerDegrees {
    int64_t pp, etp, cp;
  };
  std::vector<InnerDegrees> inner_degrees(int64_t t) const;

  const ModelSpec& model;
  const SearchOptions& options;
  const SearchOptions::Pins& pin;
  const FrameworkCapabilities& capabilities;  // of the target's framework
  const int64_t w;
  std::vector<int64_t> expert_degrees, shard_degrees, tensor_degrees, pipeline_degrees, context_degrees;
  std::vector<OffloadOption> offloads;
  std::vector<Checkpointing> checkpointing;
  std::vector<Placement> placements;
};

Space::Space(const ModelSpec& m, const ClusterSpec& cluster, const SearchOptions& o)
    : model(m), options(o), pin(o.pins), capabilities(framework(o.target).capabilities), w(o.gpus) {
  expert_degrees = divisors(w);
  for (int64_t e : divisors(model.num_experts)) expert_degrees.push_back(e);
  std::sort(expert_degrees.begin(), expert_degrees.end());
  expert_degrees.erase(std::unique(expert_degrees.begin(), expert_degrees.end()), expert_degrees.end());
  shard_degrees = divisors(w);
  for (int64_t d : divisors(w)) {
    if (d <= cluster.gpus_per_node) tensor_degrees.push_back(d);
    if (d <= model.num_layers) pipeline_degrees.push_back(d);
  }
  // Context parallelism where the framework splits sequences: powers of two that leave each
  // rank at least min_context_tokens of a sequence.
  context_degrees = {1};
  if (capabilities.context_parallelism)
    for (int64_t cp = 2; cp <= w && o.training.seq_len / cp >= o.min_context_tokens; cp *= 2)
      if (w % cp == 0) context_degrees.push_back(cp);
  if (pin.context_parallel_degree) context_degrees = {*pin.context_parallel_degree};
  offloads = {{false, 1}};
  for (int64_t h : options.loading_horizons) offloads.push_back({true, h});
  // Recomputing the attention core saves the T x T scores of unfused attention; flash
  // attention keeps none, so there it only costs time.
  checkpointing = {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull};
  if (cluster.attention == AttentionKernel::kUnfused && capabilities.attention_core_recomputation)
    checkpointing.push_back(Checkpointing::kAttentionCore);
  // Latent attention keeps every head's q, k and v, which its up projections remake cheaply.
  if (model.mla() && capabilities.latent_up_recomputation) checkpointing.push_back(Checkpointing::kLatentUpProjections);
  placements = all_placements();
  if (pin.expert_parallel_degree) expert_degrees = {*pin.expert_parallel_degree};
  if (pin.hybrid_shard_degree) shard_degrees = {*pin.hybrid_shard_degree};
  if (pin.tensor_parallel_degree) tensor_degrees = {*pin.tensor_parallel_degree};
  if (pin.pipeline_parallel_degree) pipeline_degrees = {*pin.pipeline_parallel_degree};
  if (pin.checkpointing) checkpointing = {*pin.checkpointing};
  if (pin.offloading) {
    if (!*pin.offloading) offloads = {{false, 1}};
    else if (pin.loading_horizon) offloads = {{true, *pin.loading_horizon}};
    else offloads.erase(offloads.begin());
  } else if (pin.loading_horizon) {
    offloads = {{false, 1}, {true, *pin.loading_horizon}};
  }
  if (pin.placement) {
    const std::optional<Placement> fixed = Placement::parse(*pin.placement);
    if (!fixed) throw std::invalid_argument("placement \"" + *pin.placement + "\" is not a placement");
    placements = {*fixed};
  }
}

std::vector<std::pair<int64_t, int64_t>> Space::stage_splits(int64_t pp) const {
  std::vector<std::pair<int64_t, int64_t>> out = {{0, 0}};
  if (pin.first_stage_layers || pin.last_stage_layers)
    return {{pin.first_stage_layers.value_or(0), pin.last_stage_layers.value_or(0)}};
  if (pp < 2 || model.num_layers % pp == 0 || !capabilities.uneven_pipeline_stages) return out;
  out.clear();
  // Two stages: the first takes the odd block. More: the middle stages equal, and what is left
  // on the end stages, the last (which also holds the head) taking the lighter half when the
  // rest is odd (DeepSeek-V3's 61 blocks on 8 stages: 7, 8 x 6, 6).
  const int64_t blocks = model.num_layers;
  if (pp == 2) return {{(blocks + 1) / 2, blocks / 2}};
  const int64_t even = (blocks + pp - 1) / pp;
  for (int64_t middle = even; middle <= even + 1; ++middle) {
    const int64_t rest = blocks - (pp - 2) * middle;
    const int64_t first = (rest + 1) / 2, last = rest / 2;
    if (last >= 1 && first <= middle && (first < middle || last < middle)) out.emplace_back(first, last);
  }
  return out;
}

std::vector<Space::InnerDegrees> Space::inner_degrees(int64_t t) const {
  std::vector<int64_t> splits = {0};
  if (pin.expert_tensor_parallel_degree) splits = {*pin.expert_tensor_parallel_degree == t ? 0 : *pin.expert_tensor_parallel_degree};
  else if (t > 1 && !model.dense() && capabilities.expert_tensor_folding) splits = {0, 1};
  std::vector<InnerDegrees> out;
  for (int64_t pp : pipeline_degrees)
    for (int64_t etp : splits)
      for (int64_t cp : context_degrees) out.push_back({pp, etp, cp});
  return out;
}

int64_t Space::seqs_per_reader(int64_t t, int64_t pp, int64_t cp) const {
  const TrainingConfig& training = options.training;
  const int64_t readers = t >= 1 && pp >= 1 && cp >= 1 ? w / (t * pp * cp) : 0;
  return training.seq_len > 0 && readers > 0 ? training.global_batch_tokens / (training.seq_len * readers) : 0;
}

std::vector<int64_t> Space::micro_batches(int64_t t, int64_t pp, int64_t cp) const {
  if (pin.micro_batch_size) return {*pin.micro_batch_size};
  const int64_t seqs = seqs_per_reader(t, pp, cp);
  std::vector<int64_t> out;
  for (int64_t b = 1; b <= options.max_micro_batch; ++b) {
    const bool power_of_two = (b & (b - 1)) == 0;
    if (power_of_two || (seqs > 0 && seqs % b == 0)) out.push_back(b);
  }
  return out;
}

std::vector<Variant> Space::variants(int64_t e, int64_t s, int64_t t, int64_t pp, int64_t cp) const {
  // Interleaved chunks per stage: the divisors of the stage's blocks up to 8, where the
  // micro-batches come in whole rounds of the stages.
  std::vector<int64_t> chunk_options = {1};
  if (pp > 1 && model.num_layers % pp == 0)
    for (int64_t v = 2; v <= 8 && v <= model.num_layers / pp; ++v)
      if (model.num_layers / pp % v == 0) chunk_options.push_back(v);
  // With uneven end stages: chunks that divide a middle stage's blocks and fit an end's.
  std::vector<int64_t> uneven_chunk_options = {1};
  for (const auto& [first, last] : stage_splits(pp)) {
    if (first == 0 || pp < 3) continue;
    const int64_t middle = (model.num_layers - first - last) / (pp - 2);
    for (int64_t v = 2; v <= 8 && v <= std::min(first, last); ++v)
      if (middle % v == 0) uneven_chunk_options.push_back(v);
    break;
  }
  if (pin.virtual_pipeline_degree) chunk_options = {*pin.virtual_pipeline_degree};
  std::vector<bool> sequence_options = {false};
  if (t > 1) sequence_options = {true, false};
  if (pin.sequence_parallel) sequence_options = {*pin.sequence_parallel};
  // The distributed optimizer shards states over the data-parallel ranks that hold the same
  // parameters (the dense ones: E x C x R, the mesh's E): a choice only with more than one.
  const bool replicated =
      e >= 1 && s >= 1 && t >= 1 && pp >= 1 && cp >= 1 && w % (e * s * t * pp * cp) == 0 && w / (s * t * pp) > 1;
  std::vector<bool> optimizer_options = {false};
  if (replicated && capabilities.distributed_optimizer) optimizer_options = {false, true};
  if (pin.distributed_optimizer) optimizer_options = {*pin.distributed_optimizer};
  const std::vector<bool> span_options = dense_shard_span_options(e, cp);
  std::vector<Variant> out;
  for (const auto& ends : stage_splits(pp))
    for (int64_t chunks : pin.virtual_pipeline_degree || ends.first == 0 ? chunk_options : uneven_chunk_options)
      for (bool sequence : sequence_options)
        for (bool sharded_optimizer : optimizer_options)
          for (bool span : span_options) {
            // FSDP over the expert ranks shards the optimizer states with the parameters: no
            // framework adds a distributed optimizer to it (unless both are asked for).
            if (span && e * cp > 1 && sharded_optimizer &&
                !(pin.distributed_optimizer && pin.dense_shard_spans_experts))
              continue;
            out.push_back({chunks, sequence, sharded_optimizer, span, ends});
          }
  return out;
}

std::vector<bool> Space::dense_shard_span_options(int64_t e, int64_t cp) const {
  using Span = FrameworkCapabilities::DenseShardSpan;
  if (pin.dense_shard_spans_experts) return {*pin.dense_shard_spans_experts};
  // Nothing to span: the flag would change nothing.
  if (e * cp <= 1 || capabilities.dense_shard_span == Span::kNever) return {false};
  if (capabilities.dense_shard_span == Span::kAlways) return {true};
  return {false, true};
}

// Placements matter through the shape of each dimension's groups (members per node, nodes
// spanned, groups sharing a node's card): two that give every dimension the same shapes give
// the same estimate, and the first stands for both. Degrees that do not divide the world have
// no layout, and one placement stands for all (the rules reject them). Returns (position in
// `placements`, placement) of each distinct one, and their shapes.
//
// The rules are checked with one placement for all; a folded expert group's also depends on it (E
// directly outside T): the others break expert_tensor_folds (or expert_spans_context where only
// the context ranks are folded in), and are counted in `misplaced`. `shard_span`: some variants
// shard the dense parameters over S x E x C, whose group's shape counts too.
std::pair<std::vector<std::pair<int64_t, Placement>>, std::vector<sim::LayoutShapes>> distinct_placements(
    const ClusterSpec& cluster, ParallelConfig p, const std::vector<Placement>& placements, bool shard_span,
    int64_t& misplaced) {
  const int64_t w = p.world_size, e = p.expert_data_degree(), s = p.hybrid_shard_degree,
                t = p.tensor_parallel_degree, pp = p.pipeline_parallel_degree, cp = p.context_parallel_degree;
  const bool divides = e >= 1 && s >= 1 && t >= 1 && pp >= 1 && cp >= 1 && w % (e * s * t * pp * cp) == 0 &&
                       p.expert_parallel_degree % p.expert_fold() == 0;
  std::vector<std::pair<int64_t, Placement>> distinct;
  std::vector<sim::LayoutShapes> shapes;
  std::set<std::array<int64_t, 3 * (kMeshDims + 2)>> layouts;
  for (size_t i = 0; i < placements.size(); ++i) {
    p.placement = placements[i];
    if (p.expert_fold() > 1 && !p.expert_beside_tensor()) {
      ++misplaced;
      continue;
    }
    if (!divides) {
      if (distinct.empty()) {
        distinct.emplace_back(static_cast<int64_t>(i), placements[i]);
        shapes.push_back(sim::layout_shapes(cluster, p));
      }
      continue;
    }
    const sim::LayoutShapes shape = sim::layout_shapes(cluster, p);
    std::array<int64_t, 3 * (kMeshDims + 2)> key{};
    size_t k = 0;
    const sim::GroupShape none;
    for (const sim::GroupShape* g : {&shape.replica, &shape.shard, &shape.expert, &shape.tensor, &shape.pipeline,
                                     &shape.exchange, &shape.context, shard_span ? &shape.shard_span : &none}) {
      const bool spread = g->size > 1;
      key[k++] = spread ? g->per_node : 0;
      key[k++] = spread ? g->nodes : 0;
      key[k++] = spread ? g->groups_per_node : 0;
    }
    if (!layouts.insert(key).second) continue;
    distinct.emplace_back(static_cast<int64_t>(i), placements[i]);
    shapes.push_back(shape);
  }
  return {std::move(distinct), std::move(shapes)};
}

// The best `options.keep` of the candidates that fit. Candidates are large: they are ordered
// through their indices, and only as far as needed: the analytic ranking takes the first few;
// the simulation takes the best first (they set the bound that prunes the others) and the rest
// in any order.
std::vector<Candidate> rank(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
                            const std::vector<Candidate>& fitting, SearchStats& stats) {
  std::vector<uint32_t> order(fitting.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint32_t>(i);
  const size_t head = std::min(order.size(), std::max<size_t>(4096, options.keep * 64));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(head), order.end(),
                    [&](uint32_t a, uint32_t b) { return better(fitting[a], fitting[b]); });
  std::vector<Candidate> ranked;
  if (options.estimator == Estimator::kSimulator) {
    std::vector<Candidate> simulated = simulate_best(model, cluster, options, fitting, order, stats);
    std::sort(simulated.begin(), simulated.end(), better);
    for (const Candidate& c : simulated) {
      if (ranked.size() >= options.keep) break;
      if (!horizon_duplicate(c, ranked)) ranked.push_back(c);
    }
    return ranked;
  }
  for (size_t i = 0; i < head && ranked.size() < options.keep; ++i)
    if (!horizon_duplicate(fitting[order[i]], ranked)) ranked.push_back(fitting[order[i]]);
  return ranked;
}

// The best of `ranked` (by the plan's own routing) drawn under options.routing, ordered by the
// quantile asked for; those whose busiest rank no longer fits at the p99 load are dropped.
std::vector<Candidate> rank_by_routing(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
                                       std::vector<Candidate> ranked, SearchStats& stats) {
  const RoutingProfile profile = routing_profile_from_spec(options.routing, "--routing");
  const std::vector<Diagnostic> problems =
      routing_mismatches(profile, model.num_experts, model.experts_per_token, model.moe_layers(), "");
  if (!problems.empty()) throw InputError("--routing", problems);
  std::vector<Candidate> kept;
  for (Candidate& c : ranked) {
    const RunConfig config{model, cluster, c.parallel, options.moe, options.training, options.target};
    const sim::RoutedStep r = sim::simulate_routing(config, sim::layout_shapes(cluster, c.parallel),
                                                    c.estimate.step_time_s, profile, options.routing_draws,
                                                    static_cast<uint64_t>(options.moe.random_seed));
    const int64_t tail_bytes = estimate_memory_at_load(config, r.load_p99).device_total;
    c.routed = RoutedFigures{r.median_s, r.p95_s, r.load_p99, tail_bytes, r.dropped_fraction};
    if (tail_bytes > cluster.usable_memory_bytes() && !options.ignore_memory_limits) {
      ++stats.over_device_at_tail;
      continue;
    }
    kept.push_back(std::move(c));
  }
  std::stable_sort(kept.begin(), kept.end(), [&](const Candidate& a, const Candidate& b) {
    return a.routed->ranked_s(options.rank_by) < b.routed->ranked_s(options.rank_by);
  });
  if (kept.size() > options.keep) kept.resize(options.keep);
  return kept;
}

}  // namespace

SearchResult search(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options) {
  SearchResult result;
  SearchStats& stats = result.stats;
  stats.target = options.target;
  const int64_t w = options.gpus;
  const TrainingConfig& training = options.training;
  const int64_t host_limit = host_limit_bytes(cluster, w);
  const int64_t device_limit = cluster.usable_memory_bytes();
  const Space space(model, cluster, options);

  std::vector<Candidate> fitting;
  int64_t index = 0;
  sim::KernelCostCache kernel_costs;
  for (int64_t e : space.expert_degrees) {
    for (int64_t s : space.shard_degrees) {
      for (int64_t t : space.tensor_degrees) {
        for (const auto& [pp, etp, cp] : space.inner_degrees(t)) {
          ParallelConfig p;
          p.world_size = w;
          p.expert_parallel_degree = e;
          p.hybrid_shard_degree = s;
          p.tensor_parallel_degree = t;
          p.expert_tensor_parallel_degree = etp;
          p.pipeline_parallel_degree = pp;
          p.context_parallel_degree = cp;
          p.context_exchange = options.context_exchange;
          const int64_t seqs_per_reader = space.seqs_per_reader(t, pp, cp);
          const std::vector<int64_t> micro_batches = space.micro_batches(t, pp, cp);
          const std::vector<Variant> variants = space.variants(p.expert_data_degree(), s, t, pp, cp);
          const int64_t inner = static_cast<int64_t>(variants.size() * space.checkpointing.size() *
                                                     space.offloads.size() * micro_batches.size());
          int64_t misplaced = 0;
          const bool shard_span = std::any_of(variants.begin(), variants.end(),
                                              [](const Variant& v) { return v.dense_shard_spans_experts; });
          const auto [distinct, shapes] = distinct_placements(cluster, p, space.placements, shard_span, misplaced);
          const auto tried = static_cast<int64_t>(space.placements.size());
          stats.enumerated += inner * tried;
          const auto kept = static_cast<int64_t>(distinct.size());
          stats.duplicate_placements += inner * (tried - kept - misplaced);
          stats.rule_rejected += inner * misplaced;
          const Rule misplacing = p.expert_tensor_fold() > 1 ? Rule::kExpertTensorFolds : Rule::kExpertSpansContext;
          stats.rejected_by_rule[static_cast<size_t>(misplacing)] += inner * misplaced;
          if (distinct.empty()) {
            index += inner * tried;
            continue;
          }
          p.placement = distinct.front().second;

          // Rules and memory do not depend on the placement: each is checked once for all.
          int64_t inner_index = 0;
          for (const Variant& v : variants) {
            p.virtual_pipeline_degree = v.chunks;
            p.sequence_parallel = v.sequence;
            p.distributed_optimizer = v.distributed_optimizer;
            p.dense_shard_spans_experts = v.dense_shard_spans_experts;
            p.first_stage_layers = v.ends.first;
            p.last_stage_layers = v.ends.second;
            for (Checkpointing ckpt : space.checkpointing) {
              p.activation_checkpointing = ckpt;
              for (const OffloadOption& offload : space.offloads) {
                p.activation_offloading = offload.on;
                p.activation_loading_horizon = offload.horizon;
                for (int64_t mbs : micro_batches) {
                  p.micro_batch_size = mbs;
                  p.gradient_accumulation_steps = std::max<int64_t>(1, seqs_per_reader / mbs);
                  p.placement = distinct.front().second;
                  const int64_t this_inner = inner_index++;
                  const RunConfig config{model, cluster, p, options.moe, training, options.target};
                  const RuleMask broken = violated_rules(config);
                  if (broken != 0) {
                    stats.rule_rejected += kept;
                    for (int r = 0; r < kRuleBits; ++r)
                      if (broken & (RuleMask{1} << r)) stats.rejected_by_rule[static_cast<size_t>(r)] += kept;
                    continue;
                  }
                  stats.rule_valid += kept;
                  const MemoryEstimate memory = estimate_memory(config);
                  const bool device_ok = memory.device_total <= device_limit || options.ignore_memory_limits;
                  const bool host_ok = memory.offloaded_activations <= host_limit || options.ignore_memory_limits;
                  if (!device_ok) {
                    stats.over_device_memory += kept;
                    if (!stats.closest_over_device ||
                        memory.device_total < stats.closest_over_device->memory.device_total)
                      stats.closest_over_device = Candidate{p, memory, {}, index + this_inner};
                  }
                  if (!host_ok) {
                    stats.over_host_memory += kept;
                    if (!stats.closest_over_host ||
                        memory.offloaded_activations < stats.closest_over_host->memory.offloaded_activations)
                      stats.closest_over_host = Candidate{p, memory, {}, index + this_inner};
                  }
                  if (!device_ok || !host_ok) continue;
                  for (size_t i = 0; i < distinct.size(); ++i) {
                    p.placement = distinct[i].second;
                    // Numbered as if the placements were the outer loop, as they are listed.
                    Candidate c{p, memory, {}, index + distinct[i].first * inner + this_inner};
                    const RunConfig placed{model, cluster, p, options.moe, training, options.target};
                    c.estimate = sim::estimate_step(placed, shapes[i], &kernel_costs);
                    fitting.push_back(c);
                  }
                }
              }
            }
          }
          index += inner * tried;
        }
      }
    }
  }
  stats.fitting = static_cast<int64_t>(fitting.size());
  if (options.routing.empty()) {
    result.ranked = rank(model, cluster, options, fitting, stats);
    return result;
  }
  SearchOptions pool = options;
  pool.keep = std::max(options.keep, static_cast<size_t>(std::max<int64_t>(1, options.routing_pool)));
  std::vector<Candidate> drawn = rank(model, cluster, pool, fitting, stats);
  // And the best few of every expert degree: a plan that waits for nobody (E1) or for fewer
  // ranks is drawn even where many expert-parallel plans are ahead of it by the balanced step.
  SearchOptions per_degree = options;
  per_degree.keep = std::max<size_t>(2, pool.keep / 8);
  std::map<int64_t, std::vector<Candidate>> by_degree;
  for (const Candidate& c : fitting) by_degree[c.parallel.expert_parallel_degree].push_back(c);
  for (const auto& [degree, of_degree] : by_degree) {
    for (Candidate& c : rank(model, cluster, per_degree, of_degree, stats))
      if (std::none_of(drawn.begin(), drawn.end(), [&](const Candidate& d) { return d.parallel == c.parallel; }))
        drawn.push_back(std::move(c));
  }
  result.ranked = rank_by_routing(model, cluster, options, std::move(drawn), stats);
  return result;
}

std::string stats_text(const SearchStats& s) {
  return std::to_string(s.enumerated) + " configurations: " + std::to_string(s.rule_valid) + " valid, " +
         std::to_string(s.fitting) + " fit in memory, " + std::to_string(s.simulated) +
         " simulated (the rest pruned by a lower bound" +
         (s.unsimulated > 0 ? ", or " + std::to_string(s.unsimulated) + " past the first " + std::to_string(s.simulated) +
                                   " in the analytic estimate's order"
                             : "") +
         ")";
}

Prediction predict(const RunConfig& config, Estimator estimator) {
  const bool simulate = estimator == Estimator::kSimulator;
  const sim::StepEstimate step = simulate ? sim::simulate_step(config).estimate
                                          : sim::estimate_step(config, sim::layout_shapes(config.cluster, config.parallel));
  Prediction p;
  p.estimator = name_of(kEstimatorNames, estimator);
  p.step_time_s = step.step_time_s;
  p.tokens_per_s = step.tokens_per_s;
  p.tflops_per_gpu = step.tflops_per_gpu;
  p.mfu = step.mfu;
  p.memory = to_breakdown(estimate_memory(config), config.cluster, config.parallel.world_size);
  p.time = {{"compute", step.compute_s}, {"recompute", step.recompute_s}, {"optimizer", step.optimizer_s}};
  if (simulate) {
    p.time.push_back({"exposed_comm", step.exposed_comm_s});
  } else {  // the closed form knows which communication it could not hide
    p.time.insert(p.time.end(), {{"expert_dispatch", step.expert_comm_s},
                                 {"shard_comm_exposed", step.shard_comm_exposed_s},
                                 {"offload_exposed", step.offload_exposed_s},
                                 {"grad_sync", step.grad_sync_s}});
  }
  return p;
}

Plan make_plan(const ModelSpec& model, const ClusterSpec& cluster, const SearchOptions& options,
               const SearchResult& result, const std::string& command) {
  Plan plan;
  plan.model = model;
  plan.cluster = cluster;
  plan.moe = options.moe;
  plan.training = options.training;
  plan.parallel = result.ranked.front().parallel;
  plan.prediction = predict({plan.model, plan.cluster, plan.parallel, plan.moe, plan.training}, options.estimator);
  constexpr size_t kAlternatives = 4;
  for (size_t i = 1; i < result.ranked.size() && i <= kAlternatives; ++i) {
    const Candidate& c = result.ranked[i];
    plan.alternatives.push_back({c.parallel, c.estimate.step_time_s, c.estimate.tokens_per_s,
                                 c.estimate.mfu, c.memory.device_total});
  }
  plan.provenance.moeplan_version = MOEPLAN_VERSION;
  plan.provenance.command = command;
  return plan;
}

Target executor_target() { return executor_framework().target; }

std::vector<std::string> explain_no_plan(const SearchResult& result, const ClusterSpec& cluster) {
  const SearchStats& stats = result.stats;
  std::vector<std::string> lines;
  if (stats.rule_valid == 0) {
    lines.push_back("every one of " + std::to_string(stats.enumerated) +
                    " candidate configurations breaks a validity rule (see --explain)");
    std::string framework;
    for (int r = kRuleCount; r < kRuleBits; ++r)
      if (const int64_t n = stats.rejected_by_rule[static_cast<size_t>(r)]; n > 0)
        framework += (framework.empty() ? "" : ", ") + std::string(rule_name(static_cast<Rule>(r), stats.target)) +
                     " " + std::to_string(n);
    std::string names;  // "megatron, torchtitan, smp or moeplan"
    const auto frameworks = all_frameworks();
    for (size_t i = 0; i < frameworks.size(); ++i)
      names += (i == 0 ? "" : i + 1 == frameworks.size() ? " or " : ", ") + std::string(frameworks[i]->name);
    if (!framework.empty())
      lines.push_back("the target framework's rules removed some (" + framework + "); --target " + names +
                      " plans for that framework, --target any every layout moeplan models");
    return lines;
  }
  if (const auto& c = stats.closest_over_device) {
    const int64_t limit = cluster.usable_memory_bytes();
    lines.push_back("device memory: " + std::to_string(stats.over_device_memory) + " of " +
                    std::to_string(stats.rule_valid) + " valid configurations exceed it; the closest (" +
                    describe(c->parallel) + ") needs " + gib_text(c->memory.device_total) + " per GPU against " +
                    gib_text(limit) + " usable (" + gib_text(cluster.gpu_memory_bytes) + " minus " +
                    gib_text(cluster.memory_headroom_bytes) + " headroom): over by " +
                    gib_text(c->memory.device_total - limit) + "; model states alone take " +
                    gib_text(c->memory.model_states()));
  }
  if (const auto& c = stats.closest_over_host) {
    const int64_t limit = host_limit_bytes(cluster, c->parallel.world_size);
    lines.push_back("host memory: " + std::to_string(stats.over_host_memory) +
                    " valid configurations exceed it; the closest (" + describe(c->parallel) +
                    ") offloads " + gib_text(c->memory.offloaded_activations) + " per rank against " + gib_text(limit) +
                    ": over by " + gib_text(c->memory.offloaded_activations - limit));
  }
  return lines;
}

}  // namespace moeplan::planner
