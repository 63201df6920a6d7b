#pragma once
// `moeplan calibrate`: measures this machine as a cluster of CPU ranks and writes a hardware
// profile the planner and simulator read like any other. Every rank measures at the same time,
// so each figure is what one rank gets while the others are as busy as in training:
// - matrix multiplies at the model's shapes (peak rate and efficiency curve);
// - the executor's own operations at the model's shapes (op times: attention, router and
//   dispatch, one expert, head and loss, optimizer), forward and backward apart, whole and
//   under each tensor split;
// - the executor's whole micro-batch, on one rank and on a mesh of each tensor split with its
//   collectives timed apart;
// - gloo collectives (all-gather, all-to-all, all-reduce and the reduce-scatter built from an
//   all-to-all) over a sweep of message sizes, each fitted to latency + bytes / bandwidth by
//   least squares in the terms the cost model counts;
// - memory-copy bandwidth, and the write and read bandwidth of the activation offload file;
// - the memory a rank holds beyond its live tensors (framework overhead).

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"
#include "moeplan/executor/ranks/collectives.h"
#include "moeplan/executor/ranks/mesh.h"

namespace moeplan::executor {

struct CalibrateOptions {
  ModelSpec model;
  int64_t seq_len = 256;
  Precision precision = Precision::kFp32;
  LoadBalancing load_balancing = LoadBalancing::kSinkhorn;
  int64_t max_micro_batch = 8;
  bool quick = false;        // fewer sizes and repeats (tests)
  int passes = 0;            // times every figure is measured, the lower quartile kept; 0: 5 (1 with quick)
  std::string scratch_dir;   // where the offload file is written
  // Where each rank measures: the CPU, or a GPU (one rank: the NCCL collectives of a node are
  // not measured yet, the profile keeps its base's).
  torch::Device device = torch::kCPU;
  std::string device_name = "CPU";  // as ComputeDevice names it
  std::ostream* progress = nullptr;
};

// A collective's measured times and their fit.
struct CollectiveSweep {
  std::string name;  // all_gather, all_to_all, all_reduce, reduce_scatter
  std::vector<double> bytes, seconds;  // bytes: output (all-gather), input (others) per rank
  double r_squared = 0;  // of the line fit_collective draws through the sweep
  // At the sizes of the model's flat units (kept apart from the sweep).
  std::vector<double> unit_bytes, unit_seconds;
};

// What the ranks measured: in each pass each time the slowest rank's (it sets a step's pace),
// each bandwidth the lowest; over the passes the lower quartile of the times (the upper of the
// bandwidths): the machine when no other tenant slows it.
struct Calibration {
  int64_t ranks = 1;
  int passes = 1;  // every figure measured this many times over the calibration
  // Per pass: the median over the compute times of its time over the one kept.
  std::vector<double> pass_slowdown;
  // Per pass: the share of the machine's processor time its hypervisor took while the pass ran
  // (StepRecord::steal); empty where the machine does not count it.
  std::vector<double> pass_steal;
  std::vector<std::pair<double, double>> gemm;  // (FLOPs of one GEMM, FLOP/s achieved)
  double peak_flops = 0;
  std::vector<EfficiencyPoint> efficiency;
  OpTimes op_times;
  std::vector<CollectiveSweep> collectives;
  double copy_bandwidth_bytes_per_s = 0;
  double offload_write_bytes_per_s = 0, offload_read_bytes_per_s = 0;
  int64_t overhead_bytes = 0;        // beyond live tensors: a training step's (CPU), the most seen (GPU)
  int64_t baseline_rss_bytes = 0;    // before any tensor work
  double seconds = 0;                // how long calibration took
  double rank_spread = 1;            // median over compute times of slowest / fastest rank
  // More than one rank: what each kind of collective takes beyond its back-to-back time after
  // stretches of compute, and per pass [kind x stretch] the figures before the quartile.
  AfterCompute after_compute;
  std::vector<std::vector<double>> after_compute_per_pass;
};

// Measures on this rank while every rank of `world` does the same; a collective call: every
// rank calls it with the same options. Returns the same result on every rank. With `mesh_of`,
// the executor's whole micro-batch is also measured under each tensor split of the ranks.
Calibration calibrate(const CalibrateOptions& options, Communicator& world, const MeshMaker& mesh_of = {});

// The profile `base` with what was measured in place of its numbers, each with a source that
// says how and when (`how`: the command line, host and date).
ClusterSpec calibrated_cluster(const ClusterSpec& base, const Calibration& c, const CalibrateOptions& options,
                               const std::string& name, const std::string& how);

// Everything measured, raw (the record written next to the profile).
Json to_json(const Calibration& c);

// The collective fit in the cost model's terms: latency per algorithm step and the bandwidth
// of the bytes it counts, for `ranks` ranks on one node.
CollectiveFit fit_collective(const CollectiveSweep& sweep, int64_t ranks);

}  // namespace moeplan::executor
