// `moeplan data prepare` and `moeplan run`: hand the arguments to the executor.
#include <cstdio>
#include <iostream>
#include <optional>

#include <unistd.h>

#include <ctime>
#include <fstream>

#include "command.h"
#include "executor_commands.h"
#include "moeplan/core/checksum.h"
#include "moeplan/core/duration.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/profile_files.h"
#include "moeplan/executor/calibration/calibrate.h"
#include "moeplan/executor/model/hf_checkpoint.h"
#include "moeplan/executor/model/rehearsal_fault.h"
#include "moeplan/executor/ranks/collectives.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/ranks/rank_start.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/ranks/stop.h"
#include "moeplan/executor/training/rank_run.h"
#include "moeplan/executor/training/trainer.h"

namespace moeplan::cli {

namespace {

// Called inside a catch block: one line per problem on stderr, and the exit code. Nothing is
// left to abort the process.
int report_exception(const char* command, int libtorch_exit) {
  try {
    throw;
  } catch (const InputError& e) {
    print_error(e);
    return kExitBadInput;
  } catch (const executor::CollectiveError& e) {
    std::fprintf(stderr, "moeplan: error: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    std::fprintf(stderr, "moeplan: error: %s: LibTorch: %s\n", command, what.substr(0, what.find('\n')).c_str());
    return libtorch_exit;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeplan: error: %s: %s\n", command, e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "moeplan: error: %s: an unknown error\n", command);
    return 1;
  }
}

}  // namespace

int run_run(const RunArgs& args) {
  try {
    if (args.rehearse) return run_rehearse(args);
    // From the start: a signal while the plan loads or the ranks start still stops in order.
    executor::catch_stop_signals();
    const Plan plan = read_plan_file(args.plan);
    executor::RunOptions o;
    o.data_dir = args.data.empty() ? plan.training.data : args.data;
    if (o.data_dir.empty())
      throw InputError("--data", {{"", args.plan + " names no training data (training.data); prepare some with "
                                          "`moeplan data prepare --input FILES --out DIR --vocab-size " +
                                          std::to_string(plan.model.vocab_size) + " --block-size " +
                                          std::to_string(plan.training.seq_len) +
                                          "` and pass --data DIR here or to `moeplan search`"}});
    o.out_dir = args.out;
    o.stop_after_step = args.steps;
    o.checkpoint_every = args.checkpoint_every;
    o.resume = args.resume;
    o.init_from = args.init_from;
    o.threads = args.threads;
    o.timeout_seconds = args.timeout_seconds;
    o.record_routing = args.record_routing;
    o.replay_routing = args.replay_routing;
    o.planted_fault = executor::rehearsal_fault_named(args.planted_fault, "--planted-fault");
    o.grace_seconds = args.grace_seconds;
    o.max_nonfinite_steps = args.max_nonfinite_steps;
    o.kernel_trace_step = args.kernel_trace_step;
    if (!args.stop_after.empty()) o.stop_after_seconds = parse_duration_seconds(args.stop_after, "--stop-after");
    o.progress = &std::cout;
    const std::optional<executor::RankEnv> env = executor::rank_env_from_environment();
    if (!env && plan.parallel.world_size > 1)
      // Each rank runs this command again, with its place in the run in its environment. Grace:
      // a collective's timeout, the heartbeat check, and some room.
      return executor::spawn_local_ranks(args.argv, plan.parallel.world_size, [&] { return run_run(args); },
                                         args.timeout_seconds + 15, args.grace_seconds);
    const bool multi = env.has_value();
    if (multi && env->rank != 0) o.progress = nullptr;
    const executor::RunResult r = multi ? executor::run_rank(plan, o, *env) : executor::run_training(plan, o);
    if (!r.stopped_by.empty()) return kExitStopped;
    if (multi && env->rank != 0) return kExitOk;
    if (r.report) {
      // The run folder holds what `moeplan view run/` shows: the plan, its simulated step and
      // the measured one.
      std::fputs(executor::format_summary(*r.report).c_str(), stdout);
      try {
        write_file_atomic(args.out + "/plan.json", plan_to_text(plan));
        write_simulated_trace(plan, args.out + "/simulated.json");
        std::printf("view the simulated and measured step: moeplan view %s\n", args.out.c_str());
      } catch (const std::exception& e) {  // the run itself is done and reported
        std::fprintf(stderr, "moeplan: note: %s/simulated.json not written (%s); `moeplan view` still opens "
                     "trace.json\n", args.out.c_str(), e.what());
      }
    }
    return kExitOk;
  } catch (...) {
    // LibTorch refusing something the checks let through is bad input too.
    return report_exception("run", kExitBadInput);
  }
}

namespace {

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "host";
  return name;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M UTC", &tm);
  return text;
}

std::string summary(const executor::Calibration& c, const ClusterSpec& p) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "calibrated %s: %lld ranks in %.0f s (slowest rank %.2f x the fastest)\n",
                p.name.c_str(), static_cast<long long>(c.ranks), c.seconds, c.rank_spread);
  out += line;
  if (c.passes > 1) {
    out += "  " + std::to_string(c.passes) + " passes, each one's times over the figures kept (median over compute "
           "times):";
    for (double s : c.pass_slowdown) {
      std::snprintf(line, sizeof line, " %.2f", s);
      out += line;
    }
    out += "\n";
    if (!c.pass_steal.empty()) {
      out += "  the hypervisor's steal in each pass (share of the machine):";
      for (double s : c.pass_steal) {
        std::snprintf(line, sizeof line, " %.1f%%", 100 * s);
        out += line;
      }
      out += "\n";
    }
  }
  std::snprintf(line, sizeof line, "  matrix multiply: peak %.1f GFLOP/s per rank (efficiency %.2f to %.2f)\n",
                c.peak_flops / 1e9, c.efficiency.empty() ? 0.0 : c.efficiency.front().efficiency,
                c.efficiency.empty() ? 0.0 : c.efficiency.back().efficiency);
  out += line;
  const OpTimes& t = c.op_times;
  std::snprintf(line, sizeof line,
                "  per micro-batch of %.0f tokens: attention %.2f + %.2f ms, router %.2f + %.2f ms, head %.2f ms "
                "(forward + backward)\n",
                t.attention_forward.front().first, 1e3 * t.attention_forward.front().second,
                1e3 * t.attention_backward.front().second, 1e3 * t.router_forward.front().second,
                1e3 * t.router_backward.front().second, 1e3 * t.head.front().second);
  out += line;
  for (const TensorSplitTimes& split : t.tensor_splits) {
    std::snprintf(line, sizeof line, "  split over %lld ranks: attention %.2f + %.2f ms, head %.2f ms\n",
                  static_cast<long long>(split.tensor_parallel_degree), 1e3 * split.attention_forward.front().second,
                  1e3 * split.attention_backward.front().second, 1e3 * split.head.front().second);
    out += line;
  }
  for (const executor::CollectiveSweep& s : c.collectives) {
    const CollectiveFit f = executor::fit_collective(s, c.ranks);
    std::snprintf(line, sizeof line, "  %-15s latency %7.1f us  bandwidth %6.2f GB/s  (R^2 %.3f)\n", s.name.c_str(),
                  1e6 * f.latency_s, f.bandwidth_bytes_per_s / 1e9, s.r_squared);
    out += line;
  }
  for (std::string_view kind : kAfterComputeKinds) {
    const CurvePoints& curve = *c.after_compute.of(kind);
    if (curve.empty()) continue;
    std::snprintf(line, sizeof line, "  %-15s after compute:", std::string(kind).c_str());
    out += line;
    for (const auto& [seconds, extra] : curve) {
      std::snprintf(line, sizeof line, " +%.2f ms after %.1f ms", 1e3 * extra, 1e3 * seconds);
      out += line;
    }
    out += "\n";
  }
  std::snprintf(line, sizeof line, "  memory copy %.1f GB/s; offload file write %.2f GB/s, read %.2f GB/s\n",
                c.copy_bandwidth_bytes_per_s / 1e9, c.offload_write_bytes_per_s / 1e9,
                c.offload_read_bytes_per_s / 1e9);
  out += line;
  std::snprintf(line, sizeof line, "  framework overhead %.0f MiB (%.0f MiB before any tensor work)\n",
                static_cast<double>(c.overhead_bytes) / (1 << 20), static_cast<double>(c.baseline_rss_bytes) / (1 << 20));
  out += line;
  return out;
}

}  // namespace

int run_export(const ExportArgs& args) {
  try {
    const executor::HfExport e = executor::export_hf_checkpoint(args.checkpoint, args.hf, args.max_shard_bytes);
    std::printf("exported step %lld of %s to %s: %lld tensors, %.1f MiB in %zu shards (config.json, "
                "model.safetensors.index.json)\n",
                static_cast<long long>(e.step), e.checkpoint.c_str(), args.hf.c_str(), static_cast<long long>(e.tensors),
                static_cast<double>(e.bytes) / (1 << 20), e.files.size() - 2);
    return kExitOk;
  } catch (const InputError& e) {
    for (const std::string& l : e.lines()) std::fprintf(stderr, "moeplan: error: export: %s\n", l.c_str());
    return kExitBadInput;
  }
}

int run_calibrate(const CalibrateArgs& args) {
  try {
    const std::string dir = profile_dir(args.profiles);
    executor::CalibrateOptions o;
    o.model = load_model(args.model, dir);
    const ClusterSpec base = load_hardware(args.base, dir);
    o.seq_len = args.seq_len;
    o.precision = args.precision;
    o.load_balancing = args.load_balancing;
    o.max_micro_batch = args.max_micro_batch;
    o.quick = args.quick;
    o.passes = args.passes;
    o.progress = &std::cout;
    const std::string name = args.name.empty() ? "local-" + host_name() : args.name;
    const std::string out = args.out.empty() ? name + ".json" : args.out;
    {
      // Fail before measuring, not after.
      std::ofstream probe(out + ".tmp");
      if (!probe) throw InputError("--out", {{"", "cannot write " + out}});
    }
    std::remove((out + ".tmp").c_str());
    const std::optional<executor::RankEnv> env = executor::rank_env_from_environment();
    if (!env && args.ranks > 1)
      return executor::spawn_local_ranks(args.argv, args.ranks, [&] { return run_calibrate(args); },
                                         args.timeout_seconds + 15);
    if (env && env->world_size != args.ranks)
      throw InputError("--ranks", {{"", std::to_string(args.ranks) + ", but " + env->launcher + " started " +
                                            std::to_string(env->world_size) + " ranks"}});
    executor::set_compute_threads(1);
    executor::keep_freed_memory();
    executor::install_tensor_allocator();
    executor::ignore_broken_pipes();
    const int64_t rank = env ? env->rank : 0;
    if (rank != 0) o.progress = nullptr;
    executor::JoinedWorld joined;
    if (env) joined = executor::join_world(*env, std::chrono::milliseconds(1000 * args.timeout_seconds), "calibrate/");
    // A GPU profile as the base: measured on this rank's GPU, which has to be here.
    const executor::ComputeDevice device = executor::choose_device(base, rank);
    if (base.device == DeviceKind::kCuda && !device.is_cuda())
      throw InputError("--base", {{"", base.name + " is a GPU profile, but " + device.note}});
    o.device = device.device;
    o.device_name = device.name;
    const executor::Calibration c = executor::calibrate(o, joined.world, joined.mesh_of);
    if (rank != 0) return kExitOk;
    const std::string how = "moeplan calibrate on " + host_name() + ", " + utc_now() + " (`" + args.command + "`)";
    const ClusterSpec profile = executor::calibrated_cluster(base, c, o, name, how);
    Json j;
    j["schema_version"] = 1;
    const Json body = to_json(profile);
    for (const auto& [key, value] : body.items()) j[key] = value;
    write_file_atomic(out, j.dump(2) + "\n");
    // The raw measurements beside it: out.json -> out.measured.json.
    const std::string raw = (out.size() > 5 && out.ends_with(".json") ? out.substr(0, out.size() - 5) : out) + ".measured.json";
    Json record = executor::to_json(c);
    record["command"] = args.command;
    write_file_atomic(raw, record.dump(1) + "\n");
    std::fputs(summary(c, profile).c_str(), stdout);
    std::printf("wrote %s and %s\n", out.c_str(), raw.c_str());
    return kExitOk;
  } catch (...) {
    return report_exception("calibrate", 1);
  }
}

}  // namespace moeplan::cli
