// `moeplan data prepare` and `moeplan run`: hand the arguments to the executor.
#include <cstdio>
#include <iostream>
#include <optional>

#include "commands.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/collectives.h"
#include "moeplan/executor/launch.h"
#include "moeplan/executor/parallel_trainer.h"
#include "moeplan/executor/trainer.h"

namespace moeplan::cli {

namespace {

void print_error(const InputError& e) {
  for (const std::string& line : e.lines()) std::fprintf(stderr, "moeplan: error: %s\n", line.c_str());
}

}  // namespace

int run_run(const RunArgs& args) {
  try {
    const Plan plan = read_plan_file(args.plan);
    executor::RunOptions o;
    o.data_dir = args.data;
    o.out_dir = args.out;
    o.stop_after_step = args.steps;
    o.checkpoint_every = args.checkpoint_every;
    o.resume = args.resume;
    o.threads = args.threads;
    o.timeout_seconds = args.timeout_seconds;
    o.progress = &std::cout;
    const std::optional<executor::RankEnv> env = executor::rank_env_from_environment();
    if (!env && plan.parallel.world_size > 1)
      // Grace: a collective's timeout, the heartbeat check, and some room.
      return executor::spawn_local_ranks(args.argv, plan.parallel.world_size, args.timeout_seconds + 15);
    const bool multi = env.has_value();
    if (multi && env->rank != 0) o.progress = nullptr;
    const executor::RunResult r = multi ? executor::run_rank(plan, o, *env) : executor::run_training(plan, o);
    if (multi && env->rank != 0) return kExitOk;
    if (r.report) std::fputs(executor::format_summary(*r.report).c_str(), stdout);
    return kExitOk;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  } catch (const executor::CollectiveError& e) {
    std::fprintf(stderr, "moeplan: error: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    // LibTorch refused something the checks above let through: report it, do not abort.
    const std::string what = e.what_without_backtrace();
    std::fprintf(stderr, "moeplan: error: run: LibTorch: %s\n", what.substr(0, what.find('\n')).c_str());
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeplan: error: run: %s\n", e.what());
    return 1;
  }
}

}  // namespace moeplan::cli
