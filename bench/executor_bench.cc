// Single-rank training throughput of the executor on mixtral-tiny, next to this machine's
// matrix-multiply rate; the checkpoints' checksum. Run: build/bench/bench_executor --benchmark_min_time=20
// (the Python baseline with the same settings: bench/python/mixtral_baseline.py).

#include <benchmark/benchmark.h>

#include <chrono>
#include <vector>

#include "moeplan/core/checksum.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/trainer.h"
#include "test_support.h"

namespace moeplan {
namespace {

constexpr int64_t kSeqLen = 256;
constexpr int64_t kMicroBatch = 8;

// GFLOP/s of an n x n x n matrix multiply in the given type.
void BM_Matmul(benchmark::State& state) {
  executor::set_compute_threads(static_cast<int>(state.range(1)));
  const int64_t n = state.range(0);
  const auto type = state.range(2) == 0 ? torch::kFloat : torch::kBFloat16;
  const torch::Tensor a = torch::randn({n, n}).to(type), b = torch::randn({n, n}).to(type);
  for (auto _ : state) benchmark::DoNotOptimize(torch::mm(a, b));
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * n * n * n * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(type == torch::kFloat ? "fp32" : "bf16");
}
BENCHMARK(BM_Matmul)->Args({512, 1, 0})->Args({512, 1, 1})->Args({1024, 1, 0})->Args({512, 2, 0})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

Plan tiny_plan(Precision precision) {
  Plan plan;
  plan.model = test::model("mixtral-tiny");
  plan.training.seq_len = kSeqLen;
  plan.training.precision = precision;
  plan.training.steps = 1000;
  plan.parallel.micro_batch_size = kMicroBatch;
  plan.moe.load_balancing = LoadBalancing::kAuxLoss;
  return plan;
}

// One optimizer step (one micro-batch of 8 x 256 tokens): forward, backward, clipping, AdamW.
void BM_TrainStep(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const Precision precision = state.range(1) == 0 ? Precision::kFp32 : state.range(1) == 1 ? Precision::kMixed : Precision::kBf16;
  executor::set_compute_threads(threads);
  executor::keep_freed_memory();
  executor::install_tensor_allocator();  // as a rank does
  const Plan plan = tiny_plan(precision);
  executor::ModelTrainer trainer(plan);
  torch::manual_seed(1);
  const torch::Tensor ids = torch::randint(plan.model.vocab_size, {kMicroBatch, kSeqLen}, torch::kLong);
  trainer.step({ids});  // warm-up: first-touch allocations
  for (auto _ : state) benchmark::DoNotOptimize(trainer.step({ids}));
  const double tokens = static_cast<double>(kMicroBatch * kSeqLen);
  // Model FLOPs of training: forward + 2x backward, no recompute.
  const double flops_per_token = 3 * forward_flops_per_token(plan.model, kSeqLen);
  state.counters["tokens/s"] = benchmark::Counter(tokens, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["model_GFLOP/s"] =
      benchmark::Counter(tokens * flops_per_token * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(name_of(kPrecisionNames, precision)));
}
BENCHMARK(BM_TrainStep)->Args({1, 0})->Args({1, 1})->Args({1, 2})->Args({2, 0})->Unit(benchmark::kMillisecond)->UseRealTime();

// The checksum every checkpoint shard and data file is written and verified with (bytes/s).
void BM_Crc32(benchmark::State& state) {
  std::vector<unsigned char> bytes(static_cast<size_t>(state.range(0)));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
  uint32_t crc = 0;
  for (auto _ : state) benchmark::DoNotOptimize(crc = crc32(bytes.data(), bytes.size(), crc));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_Crc32)->Arg(1 << 20)->Arg(64 << 20);

}  // namespace
}  // namespace moeplan
