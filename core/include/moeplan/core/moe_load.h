#pragma once
// How routed tokens spread over the experts, and so over the expert-parallel ranks. Either
// explicit counts per expert (given, or measured by a run) or one skew number: the busiest
// expert gets `expert_load_imbalance` times the mean share and the others split the rest.

#include <cstdint>
#include <vector>

#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"

namespace moeplan {

// Share of all token-expert slots each expert receives; they add up to 1.
std::vector<double> expert_shares(const ModelSpec& model, const MoeConfig& moe);

// Load of expert-parallel rank `rank` (holding experts [rank n/E, (rank+1) n/E)) over the mean
// rank load: 1 when balanced. Allocation-free, for the search's hot path.
double expert_rank_load(const ModelSpec& model, const MoeConfig& moe, int64_t expert_degree, int64_t rank);
// The largest expert_rank_load over the E ranks.
double busiest_expert_rank_load(const ModelSpec& model, const MoeConfig& moe, int64_t expert_degree);

// `moe` with tokens_per_expert set so that the first of `expert_degree` ranks carries `load`
// times the mean rank load, spread evenly over its experts, and the other ranks share the rest
// evenly: the busiest-rank load the routing profile gave one micro-batch, as the memory model and
// the step estimate take it. `load` is kept within [1, expert_degree] and below what top-k
// allows (no expert above 1/experts_per_token of the slots).
MoeConfig with_busiest_rank_load(const ModelSpec& model, const MoeConfig& moe, int64_t expert_degree, double load);

}  // namespace moeplan
