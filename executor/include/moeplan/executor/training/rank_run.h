#pragma once
// One rank of a multi-rank run (moeplan's own launcher, torchrun, SLURM or Open MPI start it).

#include "moeplan/core/plan.h"
#include "moeplan/executor/ranks/rank_start.h"
#include "moeplan/executor/training/trainer.h"

namespace moeplan::executor {

// One rank of a multi-rank run: joins the others, trains, writes its part of checkpoints, the
// trace and the report. Throws InputError for bad input, CollectiveError when a peer is lost.
RunResult run_rank(const Plan& plan, const RunOptions& options, const RankEnv& env);

}  // namespace moeplan::executor
