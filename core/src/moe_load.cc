#include "moeplan/core/moe_load.h"

#include <algorithm>

namespace moeplan {

namespace {

// Share of expert i, without building the vector.
double share(const ModelSpec& m, const MoeConfig& moe, double total, int64_t i) {
  const auto n = static_cast<double>(m.num_experts);
  if (!moe.tokens_per_expert.empty()) return moe.tokens_per_expert[static_cast<size_t>(i)] / total;
  if (m.num_experts == 1) return 1.0;
  const double busiest = moe.expert_load_imbalance / n;
  return i == 0 ? busiest : (1.0 - busiest) / (n - 1.0);
}

double total_count(const MoeConfig& moe) {
  double total = 0;
  for (double c : moe.tokens_per_expert) total += c;
  return total;
}

}  // namespace

std::vector<double> expert_shares(const ModelSpec& m, const MoeConfig& moe) {
  const double total = total_count(moe);
  std::vector<double> out(static_cast<size_t>(m.num_experts));
  for (int64_t i = 0; i < m.num_experts; ++i) out[static_cast<size_t>(i)] = share(m, moe, total, i);
  return out;
}

double computed_share(double share, int64_t num_experts, const MoeConfig& moe) {
  if (!(moe.capacity_factor > 0)) return share;
  const double capacity = moe.capacity_factor / static_cast<double>(std::max<int64_t>(1, num_experts));
  return moe.pad_to_capacity ? capacity : std::min(share, capacity);
}

double dropped_fraction(std::span<const double> shares, const MoeConfig& moe) {
  if (!(moe.capacity_factor > 0)) return 0;
  const auto n = static_cast<int64_t>(shares.size());
  double dropped = 0;
  for (double s : shares) dropped += std::max(0.0, s - moe.capacity_factor / static_cast<double>(n));
  return dropped;
}

double dropped_fraction(const ModelSpec& m, const MoeConfig& moe) {
  const std::vector<double> shares = expert_shares(m, moe);
  return dropped_fraction(shares, moe);
}

namespace {

// Calls `each(load)` with every one of `expert_degree` ranks' computed slots over the mean rank's
// received slots (1 for every rank when no slot was routed).
template <class Each>
void for_each_rank_load(std::span<const double> shares, int64_t expert_degree, const MoeConfig& moe, Each each) {
  const auto n = static_cast<int64_t>(shares.size());
  const int64_t e = std::clamp<int64_t>(expert_degree, 1, std::max<int64_t>(1, n));
  const int64_t local = n / e;
  double total = 0;
  for (double s : shares) total += s;
  for (int64_t r = 0; r < e; ++r) {
    double load = 0;
    for (int64_t i = r * local; i < (r + 1) * local; ++i) load += computed_share(shares[static_cast<size_t>(i)], n, moe);
    each(total > 0 ? load * static_cast<double>(e) / total : 1.0);
  }
}

}  // namespace

double busiest_rank_load(std::span<const double> shares, int64_t expert_degree, const MoeConfig& moe) {
  double most = 0;
  for_each_rank_load(shares, expert_degree, moe, [&](double load) { most = std::max(most, load); });
  return most;
}

void rank_loads(std::span<const double> shares, int64_t expert_degree, const MoeConfig& moe, std::vector<double>& out) {
  out.clear();
  for_each_rank_load(shares, expert_degree, moe, [&](double load) { out.push_back(load); });
}

double expert_rank_load(const ModelSpec& m, const MoeConfig& moe, int64_t expert_degree, int64_t rank) {
  const double total = total_count(moe);
  const int64_t local = m.num_experts / expert_degree;
  double load = 0;
  for (int64_t i = rank * local; i < (rank + 1) * local; ++i)
    load += computed_share(share(m, moe, total, i), m.num_experts, moe);
  return load * static_cast<double>(expert_degree);
}

double busiest_expert_rank_load(const ModelSpec& m, const MoeConfig& moe, int64_t expert_degree) {
  double most = 0;
  for (int64_t r = 0; r < expert_degree; ++r) most = std::max(most, expert_rank_load(m, moe, expert_degree, r));
  return most;
}

MoeConfig with_busiest_rank_load(const ModelSpec& m, const MoeConfig& moe, int64_t expert_degree, double load) {
  MoeConfig out = moe;
  const auto n = static_cast<double>(m.num_experts);
  const auto e = static_cast<double>(std::max<int64_t>(1, expert_degree));
  const double local = n / e;
  const double k = static_cast<double>(std::max<int64_t>(1, m.experts_per_token));
  // Under a capacity factor every rank may compute less than the mean (the hot experts clipped
  // at their capacity, the others short of it): a busiest rank below 1 is every rank at that
  // load, each expert's computed slots clipped to load / n.
  if (moe.capacity_factor > 0 && !moe.pad_to_capacity && load < 1.0) {
    out.tokens_per_expert.assign(static_cast<size_t>(m.num_experts), 1.0 / n);
    out.capacity_factor = std::max(load, 1.0 / 256.0);
    return out;
  }
  // Each expert of the busiest rank takes load / n of the slots; at most 1 / k.
  const double l = std::clamp(load, 1.0, std::max(1.0, std::min(e, n / k)));
  out.tokens_per_expert.assign(static_cast<size_t>(m.num_experts), 0.0);
  for (int64_t i = 0; i < m.num_experts; ++i) {
    const bool busiest = static_cast<double>(i) < local;
    out.tokens_per_expert[static_cast<size_t>(i)] = busiest || e == 1 ? l / n : (1.0 - l / e) / (n - local);
  }
  return out;
}

}  // namespace moeplan
