// What calibration measures of moving bytes: memory copies, the activation offload file (host
// copies on a GPU), the collectives alone, and the collectives after compute.
#include "measure.h"

namespace moeplan::executor::calibration {

namespace {

// On a GPU: a device-to-device copy (bytes read and written), and copies between pinned host
// memory and the device each way (the activation offload's path).
CopyFigures measure_device_copies(Workload& x, OverheadProbe& overhead) {
  const int64_t n = int64_t{64} << 20;  // 256 MiB of fp32
  const torch::Tensor a = torch::randn({n}).to(x.device), b = torch::empty_like(a);
  CopyFigures figures;
  const double copy = time_median(x.device, x.reps, [&] { b.copy_(a); });
  figures.copy_bytes_per_s = 2.0 * static_cast<double>(n) * 4 / copy;
  const torch::Tensor host = torch::empty({n}).pin_memory();
  const double down = time_median(x.device, x.reps, [&] { host.copy_(a, /*non_blocking=*/true); });
  const double up = time_median(x.device, x.reps, [&] { b.copy_(host, /*non_blocking=*/true); });
  figures.offload_write_bytes_per_s = static_cast<double>(n) * 4 / down;
  figures.offload_read_bytes_per_s = static_cast<double>(n) * 4 / up;
  overhead.sample();
  return figures;
}

// What one collective of `kind` takes on `bytes` per rank, the mean of `calls` calls.
double time_collective(Workload& x, const std::string& kind, int64_t bytes) {
  const int64_t n = x.n;
  const int64_t elems = bytes / x.a / n * n;  // a multiple of the ranks
  const torch::Tensor full = torch::randn({elems}).to(x.a == 4 ? torch::kFloat : torch::kBFloat16);
  const torch::Tensor shard = torch::randn({elems / n}).to(full.scalar_type());
  const std::vector<int64_t> rows(static_cast<size_t>(n), elems / n);
  // Many calls: the mean has to see the tail.
  const int r = bytes <= (1 << 20) ? 60 / x.few : 15 / x.few;
  x.world.barrier();
  double s = 0;
  if (kind == "all_gather") s = time_mean(x.device, r, [&] { (void)x.world.all_gather(shard); });
  if (kind == "all_to_all")
    s = time_mean(x.device, r, [&] { (void)x.world.all_to_all(full.view({elems, 1}), rows, rows); });
  if (kind == "all_reduce") {
    torch::Tensor buffer = full.clone();
    s = time_mean(x.device, r, [&] { x.world.all_reduce_sum(buffer); });
  }
  if (kind == "reduce_scatter") s = time_mean(x.device, r, [&] { (void)x.world.reduce_scatter_sum(full); });
  return s;
}

// One collective after `stretch` in lockstep: each call's stretch and collective timed apart on
// every rank, then gathered. A step pays, beyond the stretch's own time and the collective back
// to back (`alone`), how far the slowest rank's stretch runs past it (the median over the calls)
// and how far the collective on the rank that came last (it waited for nobody) runs past its
// back-to-back time (the mean: the tail counts).
AfterComputeFigures time_after_stretch(Workload& x, const std::function<void()>& collective, const Stretch& stretch,
                                       double alone) {
  std::vector<double> times(static_cast<size_t>(2 * stretch.calls + 1));
  x.world.barrier();
  for (int i = 0; i <= stretch.calls; ++i) {
    auto start = Clock::now();
    stretch.work();
    const double work_s = seconds_since(start);
    start = Clock::now();
    collective();
    if (i == 0) continue;  // warm-up
    times[static_cast<size_t>(i - 1)] = work_s;
    times[static_cast<size_t>(stretch.calls + i - 1)] = seconds_since(start);
  }
  times.back() = alone;
  const torch::Tensor all = x.world.all_gather(torch::tensor(times, torch::kDouble).unsqueeze(0));
  const int64_t calls = stretch.calls;
  const torch::Tensor work = all.narrow(1, 0, calls), after = all.narrow(1, calls, calls);
  double own = 0;
  for (int64_t rank = 0; rank < work.size(0); ++rank) own = std::max(own, median_of(work[rank]));
  const double behind = median_of(std::get<0>(work.max(0))) - own;
  const double longer =
      std::get<0>(after.min(0)).mean().item<double>() - all.select(1, 2 * calls).max().item<double>();
  return {own, behind + longer};
}

}  // namespace

// Memory copy bandwidth, and the offload file's write and read bandwidth for the blocks of the
// largest micro-batch.
CopyFigures measure_copies(Workload& x, OverheadProbe& overhead) {
  if (x.device.is_cuda()) return measure_device_copies(x, overhead);
  const int64_t n = int64_t{16} << 20;  // 64 MiB of fp32
  const torch::Tensor a = torch::randn({n}), b = torch::empty({n});
  CopyFigures figures;
  const double copy = time_median(x.device, x.reps, [&] { b.copy_(a); });
  figures.copy_bytes_per_s = 2.0 * static_cast<double>(n) * 4 / copy;  // read and written
  overhead.sample();
  const torch::Tensor act = torch::randn({x.o.max_micro_batch * x.t * x.h}).to(x.type);  // one block input
  const int64_t blocks = x.m.num_layers;
  double write = 0, read = 0;
  for (int i = 0; i <= x.reps; ++i) {
    auto start = Clock::now();
    for (int64_t k = 0; k < blocks; ++k) x.store.put(k, act);
    const double w_s = seconds_since(start);
    start = Clock::now();
    for (int64_t k = blocks - 1; k >= 0; --k) (void)x.store.take(k);
    const double r_s = seconds_since(start);
    x.store.clear();
    if (i == 0) continue;
    write += w_s;
    read += r_s;
  }
  const double bytes = static_cast<double>(blocks * act.nbytes()) * x.reps;
  figures.offload_write_bytes_per_s = bytes / write;
  figures.offload_read_bytes_per_s = bytes / read;
  return figures;
}

// Each kind of gloo collective over the sweep of sizes and the model's units.
std::vector<CollectiveFigures> measure_collectives(Workload& x, Progress& progress, const std::string& of) {
  std::vector<CollectiveFigures> collectives;
  for (const std::string& kind : x.kinds) {
    const std::vector<int64_t>& units = x.unit_sizes[kind];
    progress.say("gloo " + kind + ", " + std::to_string(x.sizes.size() + units.size()) + " sizes" + of);
    CollectiveFigures figures;
    for (int64_t bytes : x.sizes) figures.sweep.push_back(time_collective(x, kind, bytes));
    for (int64_t bytes : units) figures.units.push_back(time_collective(x, kind, bytes));
    collectives.push_back(std::move(figures));
  }
  return collectives;
}

// Each kind of collective back to back, then after stretches of compute of a few lengths in
// lockstep. What the pair takes beyond the stretch alone and the collective alone is what a
// collective costs in a step for following compute: a longer tail (its threads have to be
// woken), and the wait for the rank that fell behind. Per kind and stretch: the stretch's own
// time and that extra.
std::vector<std::vector<AfterComputeFigures>> measure_after_compute(Workload& x) {
  std::vector<std::vector<AfterComputeFigures>> per_kind;
  for (const auto& named : x.after_collectives) {
    const std::function<void()>& collective = named.second;
    x.world.barrier();
    const double alone = time_mean(x.device, 60 / x.few, collective);
    std::vector<AfterComputeFigures> figures;
    for (const Stretch& stretch : x.stretches) figures.push_back(time_after_stretch(x, collective, stretch, alone));
    per_kind.push_back(std::move(figures));
  }
  return per_kind;
}

}  // namespace moeplan::executor::calibration
