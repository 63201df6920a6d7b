#pragma once
// How routed tokens spread over the experts, and so over the expert-parallel ranks. Either
// explicit counts per expert (given, or measured by a run) or one skew number: the busiest
// expert gets `expert_load_imbalance` times the mean share and the others split the rest.

#include <cstdint>
#include <span>
#include <vector>

#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"

namespace moeplan {

// Share of all token-expert slots each expert receives; they add up to 1.
std::vector<double> expert_shares(const ModelSpec& model, const MoeConfig& moe);

// What an expert that received `share` of a micro-batch's slots computes of them under moe's
// capacity: at most capacity_factor / n, exactly that when padded, all of it when dropless.
double computed_share(double share, int64_t num_experts, const MoeConfig& moe);
// The fraction of a micro-batch's slots dropped at moe's capacity (0 when dropless), for one
// micro-batch's shares or the plan's own routing.
double dropped_fraction(std::span<const double> shares, const MoeConfig& moe);
double dropped_fraction(const ModelSpec& model, const MoeConfig& moe);
// The busiest of `expert_degree` ranks' computed slots (rank r holds experts [r n/E, (r+1) n/E))
// over the mean rank's received slots, for one micro-batch's shares under moe's capacity.
// 1 when balanced, and 1 with E = 1.
double busiest_rank_load(std::span<const double> shares, int64_t expert_degree, const MoeConfig& moe = {});
// Every rank's load as busiest_rank_load counts it (the busiest is the largest), written into
// `out`, resized to the ranks.
void rank_loads(std::span<const double> shares, int64_t expert_degree, const MoeConfig& moe, std::vector<double>& out);

// Load of expert-parallel rank `rank` (holding experts [rank n/E, (rank+1) n/E)) over the mean
// rank load: 1 when balanced; what it computes under a capacity factor. Allocation-free, for the
// search's hot path.
double expert_rank_load(const ModelSpec& model, const MoeConfig& moe, int64_t expert_degree, int64_t rank);
// The largest expert_rank_load over the E ranks.
double busiest_expert_rank_load(const ModelSpec& model, const MoeConfig& moe, int64_t expert_degree);

// `moe` with tokens_per_expert set so that the first of `expert_degree` ranks carries `load`
// times the mean rank load, spread evenly over its experts, and the other ranks share the rest
// evenly: the busiest-rank load the routing profile gave one micro-batch, as the memory model and
// the step estimate take it. `load` is kept within [1, expert_degree] and below what top-k
// allows (no expert above 1/experts_per_token of the slots), except under an unpadded capacity
// factor, where a load below 1 is every rank computing that load (each expert clipped to
// load / n: the capacity dropped slots from every rank).
MoeConfig with_busiest_rank_load(const ModelSpec& model, const MoeConfig& moe, int64_t expert_degree, double load);

}  // namespace moeplan
