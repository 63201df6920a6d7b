#include "moeplan/simulator/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "moeplan/core/fit.h"
#include "moeplan/core/moe_load.h"

namespace moeplan::sim {

namespace {

constexpr double kLoadSteps = 256;  // loads are priced in 1/256ths

}  // namespace

RoutingDelay::RoutingDelay(const RunConfig& config, const LayoutShapes& shapes)
    : config_(config), shapes_(shapes), expert_degree_(std::max<int64_t>(1, config.parallel.expert_parallel_degree)) {
  const ParallelConfig& p = config_.parallel;
  base_load_ = busiest_expert_rank_load(config_.model, config_.moe, expert_degree_);
  base_step_s_ = estimate_step(config_, shapes_).step_time_s;
  int64_t most = 0;
  for (int64_t s = 0; s < std::max<int64_t>(1, p.pipeline_parallel_degree); ++s) {
    // The stage's blocks with routed experts, multi-token prediction blocks left out (the
    // profile has the model's MoE blocks).
    const int64_t blocks = std::min(stage_block_counts(config_.model, p, s).moe_layers,
                                    config_.model.moe_layers() - std::accumulate(stage_moe_blocks_.begin(),
                                                                                 stage_moe_blocks_.end(), int64_t{0}));
    stage_moe_blocks_.push_back(std::max<int64_t>(0, blocks));
    most = std::max(most, blocks);
  }
  blocks_ = static_cast<double>(std::max<int64_t>(1, most)) *
            static_cast<double>(std::max<int64_t>(1, p.gradient_accumulation_steps));
}

double RoutingDelay::block_delay_s(double load) {
  if (expert_degree_ == 1 || config_.model.dense()) return 0;
  const auto key = static_cast<int64_t>(std::llround(load * kLoadSteps));
  if (const auto it = by_load_.find(key); it != by_load_.end()) return it->second;
  const MoeConfig moe =
      with_busiest_rank_load(config_.model, config_.moe, expert_degree_, static_cast<double>(key) / kLoadSteps);
  const RunConfig at{config_.model, config_.cluster, config_.parallel, moe, config_.training, config_.target};
  const double delay = (estimate_step(at, shapes_).step_time_s - base_step_s_) / blocks_;
  by_load_.emplace(key, delay);
  return delay;
}

double RoutingDelay::delay_s(const StepRouting& loads) {
  double slowest = 0;
  size_t block = 0;
  for (const int64_t blocks : stage_moe_blocks_) {
    double stage = 0;
    for (int64_t b = 0; b < blocks && block < loads.size(); ++b, ++block)
      for (const std::vector<double>& shares : loads[block]) stage += block_delay_s(busiest_rank_load(shares, expert_degree_, config_.moe));
    slowest = std::max(slowest, stage);
  }
  return slowest;
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
    out.step_s.push_back(base_step_s + delay.delay_s(step));
  }
  out.dropped_fraction = loads.empty() ? 0.0 : dropped / static_cast<double>(loads.size());
  out.median_s = quantile(out.step_s, 0.5);
  out.p95_s = quantile(out.step_s, 0.95);
  out.load_median = loads.empty() ? 1.0 : quantile(loads, 0.5);
  out.load_p99 = loads.empty() ? 1.0 : quantile(loads, 0.99);
  return out;
}

}  // namespace moeplan::sim
