#include "moeplan/simulator/routing.h"

#include <algorithm>
#include <cmath>

#include "moeplan/core/fit.h"
#include "moeplan/core/moe_load.h"

namespace moeplan::sim {

namespace {

constexpr double kLoadSteps = 256;  // loads are priced in 1/256ths

}  // namespace

RoutingDelay::RoutingDelay(const RunConfig& config, const LayoutShapes& shapes)
    : config_(config), shapes_(shapes), expert_degree_(std::max<int64_t>(1, config.parallel.expert_parallel_degree)) {
  const ParallelConfig& p = config_.parallel;
  const ModelSpec& m = config_.model;
  base_load_ = busiest_expert_rank_load(m, config_.moe, expert_degree_);
  base_step_s_ = estimate_step(config_, shapes_).step_time_s;
  // Each block's stage in block order: chunk v of every stage, then chunk v + 1 (Megatron's
  // interleaved order; one chunk a stage without interleaving), each stage's blocks split
  // evenly over its chunks.
  const int64_t stages = std::max<int64_t>(1, p.pipeline_parallel_degree);
  const int64_t chunks = std::max<int64_t>(1, p.virtual_pipeline_degree);
  std::vector<int64_t> stage_of_block;
  for (int64_t v = 0; v < chunks; ++v)
    for (int64_t s = 0; s < stages; ++s)
      for (int64_t b = 0; b < stage_layers(m.num_layers, p, s) / chunks; ++b) stage_of_block.push_back(s);
  stage_of_block.resize(static_cast<size_t>(m.num_layers), stages - 1);
  std::vector<int64_t> per_stage(static_cast<size_t>(stages), 0);
  for (int64_t i = 0; i < m.num_layers; ++i) {
    if (!m.moe_layer(i)) continue;
    moe_block_stage_.push_back(stage_of_block[static_cast<size_t>(i)]);
    ++per_stage[static_cast<size_t>(moe_block_stage_.back())];
  }
  blocks_ = static_cast<double>(std::max<int64_t>(1, *std::max_element(per_stage.begin(), per_stage.end()))) *
            static_cast<double>(std::max<int64_t>(1, p.gradient_accumulation_steps));
  if (const ClusterSpec& c = config_.cluster; c.host_processors > 0 && c.host_processors < c.gpus_per_node) {
    const auto group = static_cast<double>(std::min(expert_degree_, c.gpus_per_node));
    group_processors_ = static_cast<double>(c.host_processors) * group / static_cast<double>(c.gpus_per_node);
    balanced_makespan_ = shared_makespan(std::vector<double>(static_cast<size_t>(expert_degree_), 1.0), group_processors_);
  }
}

double shared_makespan(std::vector<double> work, double processors) {
  std::sort(work.begin(), work.end());
  double t = 0, done = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    // The shortest unfinished job ends next; until then every unfinished one moves at this rate.
    const double rate = std::min(1.0, processors / static_cast<double>(work.size() - i));
    t += (work[i] - done) / rate;
    done = work[i];
  }
  return t;
}

double RoutingDelay::priced_load(std::span<const double> shares) {
  if (!(group_processors_ > 0)) return busiest_rank_load(shares, expert_degree_, config_.moe);
  rank_loads(shares, expert_degree_, config_.moe, rank_loads_);
  return shared_makespan(rank_loads_, group_processors_) / balanced_makespan_;
}

double RoutingDelay::block_delay_s(double load) {
  // One expert rank waits for nobody; under a capacity factor it may still compute less.
  if (config_.model.dense() || (expert_degree_ == 1 && !(config_.moe.capacity_factor > 0))) return 0;
  const auto key = static_cast<int64_t>(std::llround(load * kLoadSteps));
  if (const auto it = by_load_.find(key); it != by_load_.end()) return it->second;
  const MoeConfig moe =
      with_busiest_rank_load(config_.model, config_.moe, expert_degree_, static_cast<double>(key) / kLoadSteps);
  const RunConfig at{config_.model, config_.cluster, config_.parallel, moe, config_.training, config_.target};
  // A busier rank than the plan's own makes the others wait; a lighter one (under a capacity
  // factor) is every rank computing less.
  const double delay = (estimate_step(at, shapes_).step_time_s - base_step_s_) / blocks_;
  by_load_.emplace(key, delay);
  return delay;
}

double RoutingDelay::delay_s(const StepRouting& loads) {
  std::vector<double> by_stage(static_cast<size_t>(std::max<int64_t>(1, config_.parallel.pipeline_parallel_degree)), 0.0);
  for (size_t block = 0; block < loads.size() && block < moe_block_stage_.size(); ++block)
    for (const std::vector<double>& shares : loads[block])
      by_stage[static_cast<size_t>(moe_block_stage_[block])] +=
          block_delay_s(priced_load(shares));
  return *std::max_element(by_stage.begin(), by_stage.end());
}

RoutedStep simulate_routing(const RunConfig& config, const LayoutShapes& shapes, double base_step_s,
                            const RoutingProfile& profile, int64_t draws, uint64_t seed) {
  RoutingDelay delay(config, shapes);
  RoutedStep out;
  out.base_step_s = base_step_s;
  out.base_load = delay.base_load();
  const ParallelConfig& p = config.parallel;
  const ModelSpec& m = config.model;
  // The token-expert slots of one micro-batch over the expert group: the chance spread of a
  // skewed draw depends on them.
  const double slots = static_cast<double>(delay.expert_degree() * p.micro_batch_size *
                                           p.local_seq_len(config.training.seq_len) * m.experts_per_token);
  RoutingRng rng(seed);
  // The profile's step spread, drawn from a stream of its own: the routing draws are the same
  // with it and without.
  RoutingRng spread_rng(seed ^ 0x5bd1e995ULL);
  const std::vector<double>& spread = profile.step_spread;
  std::vector<double> loads;
  double dropped = 0;
  for (int64_t d = 0; d < draws; ++d) {
    const StepRouting step = draw_step_routing(profile, m.num_experts, m.moe_layers(),
                                               std::max<int64_t>(1, p.gradient_accumulation_steps), slots, rng);
    for (const auto& block : step)
      for (const auto& shares : block) {
        loads.push_back(busiest_rank_load(shares, delay.expert_degree(), config.moe));
        dropped += dropped_fraction(shares, config.moe);
      }
    double step_s = base_step_s + delay.delay_s(step);
    if (!spread.empty())
      step_s *= spread[spread_rng.index(spread.size())];
    out.step_s.push_back(step_s);
  }
  out.dropped_fraction = loads.empty() ? 0.0 : dropped / static_cast<double>(loads.size());
  out.median_s = quantile(out.step_s, 0.5);
  out.p95_s = quantile(out.step_s, 0.95);
  out.load_median = loads.empty() ? 1.0 : quantile(loads, 0.5);
  out.load_p99 = loads.empty() ? 1.0 : quantile(loads, 0.99);
  return out;
}

}  // namespace moeplan::sim
