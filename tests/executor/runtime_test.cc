// The live-tensor counter behind report.json's peak_tensor_bytes_per_rank, and the machine's
// steal behind each step's.

#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/run.h"
#include "moeplan/executor/training/run_measurement.h"
#include "test_support.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include "moeplan/executor/libtorch.h"

#include <fstream>
#include <string>

namespace moeplan::executor {
namespace {

TEST(TensorBytes, CountsLiveTensorsAndKeepsThePeak) {
  install_tensor_allocator();
  install_tensor_allocator();  // a second call changes nothing
  reset_peak_tensor_bytes();
  const TensorBytes before = tensor_bytes();
  constexpr int64_t kBytes = 4 << 20;
  {
    torch::Tensor a = torch::ones({kBytes / 4}, torch::kFloat);
    const TensorBytes during = tensor_bytes();
    EXPECT_GE(during.live - before.live, kBytes);
    torch::Tensor b = a * 2;  // an op's output is counted too
    EXPECT_GE(tensor_bytes().live - before.live, 2 * kBytes);
    EXPECT_EQ(b.sum().item<float>(), 2.0f * (kBytes / 4));
  }
  const TensorBytes after = tensor_bytes();
  EXPECT_LE(after.live, before.live + 1024);  // freed (a scalar or two may remain)
  EXPECT_GE(after.peak - before.live, 2 * kBytes);
  reset_peak_tensor_bytes();
  EXPECT_EQ(tensor_bytes().peak, tensor_bytes().live);
}

// report.json's peak_step_tensor_bytes_per_rank: what happens between steps (building the model,
// saving a checkpoint) counts for the whole run, not for the steps.
TEST(StepPeaks, LeaveOutWhatHappensBetweenSteps) {
  install_tensor_allocator();
  reset_peak_tensor_bytes();
  const int64_t base = tensor_bytes().live;
  constexpr int64_t kBig = 16 << 20, kSmall = 4 << 20;
  StepPeaks peaks;
  { torch::Tensor setup = torch::ones({kBig / 4}, torch::kFloat); }  // before the first step
  for (int step = 0; step < 2; ++step) {
    peaks.begin_step();
    { torch::Tensor work = torch::ones({kSmall / 4}, torch::kFloat); }
    peaks.end_step();
    { torch::Tensor save = torch::ones({kBig / 4}, torch::kFloat); }  // a checkpoint after the step
  }
  EXPECT_GE(peaks.steps() - base, kSmall);
  EXPECT_LT(peaks.steps() - base, kBig);
  EXPECT_GE(peaks.whole_run() - base, kBig);
}

// /proc/stat's first line sums every processor; steal is its eighth number (proc(5)).
TEST(ProcessorTimes, ReadTheStealOfEveryProcessor) {
  test::TempDir dir;
  const std::optional<ProcessorTimes> t = processor_times(
      dir.write("stat", "cpu  100 5 50 800 10 1 4 30 7 0\ncpu0 50 2 25 400 5 0 2 15 3 0\nintr 12345\n"));
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->total, 100 + 5 + 50 + 800 + 10 + 1 + 4 + 30);  // guest time is inside user already
  EXPECT_EQ(t->steal, 30);
  // A kernel too old to count steal, a file that is not /proc/stat, no file: not known.
  EXPECT_FALSE(processor_times(dir.write("old", "cpu  100 5 50 800 10 1 4\n")).has_value());
  EXPECT_FALSE(processor_times(dir.write("other", "intr 1 2 3 4 5 6 7 8\n")).has_value());
  EXPECT_FALSE(processor_times(dir.file("missing")).has_value());
  if (!processor_times().has_value()) GTEST_SKIP() << "this machine's /proc/stat does not count steal";
  const ProcessorTimes now = *processor_times();
  EXPECT_GT(now.total, 0);
  EXPECT_LE(now.steal, now.total);
}

// A run appends a line a step; whoever reads the file meanwhile may find the last line half
// written, and leaves it for the next read.
TEST(Metrics, ALineStillBeingWrittenIsLeftOut) {
  test::TempDir dir;
  dir.write("metrics.jsonl", "{\"step\":1}\n{\"step\":2,\"loss\":[1,");
  ASSERT_EQ(read_metrics(dir.path().string()).size(), 1u);
  dir.write("metrics.jsonl", "{\"step\":1}\n{\"step\":2,\"loss\":[1, 2]}\n");
  EXPECT_EQ(read_metrics(dir.path().string()).size(), 2u);
  EXPECT_TRUE(read_metrics(dir.file("missing")).empty());
}

TEST(ProcessorTimes, StealShareIsTheStolenPartOfTheTimeBetween) {
  const ProcessorTimes a{1000, 10}, b{1200, 60};
  EXPECT_DOUBLE_EQ(*steal_share(a, b), 50.0 / 200);
  EXPECT_DOUBLE_EQ(*steal_share(a, ProcessorTimes{1200, 10}), 0);
  EXPECT_FALSE(steal_share(a, a).has_value());  // no time between
  EXPECT_FALSE(steal_share(b, a).has_value());  // readings out of order
  EXPECT_FALSE(steal_share(std::nullopt, b).has_value());
  EXPECT_FALSE(steal_share(a, std::nullopt).has_value());
}

// Some kernels take raw memory from the CPU allocator (raw_allocate), which requires the data
// pointer to be its own context; the counter must serve them and count them.
TEST(TensorBytes, ServesRawAllocations) {
  install_tensor_allocator();
  c10::Allocator* allocator = c10::GetCPUAllocator();
  const int64_t before = tensor_bytes().live;
  void* p = allocator->raw_allocate(1 << 20);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % c10::gAlignment, 0u);
  static_cast<char*>(p)[0] = 1;
  static_cast<char*>(p)[(1 << 20) - 1] = 2;
  EXPECT_EQ(tensor_bytes().live - before, 1 << 20);
  allocator->raw_deallocate(p);
  EXPECT_EQ(tensor_bytes().live, before);
}

namespace {
// Whether an address lies in one of the process's mappings (/proc/self/maps).
bool mapped(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::string line;
  while (std::getline(maps, line)) {
    const size_t dash = line.find('-');
    const uintptr_t begin = std::stoull(line.substr(0, dash), nullptr, 16);
    const uintptr_t end = std::stoull(line.substr(dash + 1), nullptr, 16);
    if (a >= begin && a < end) return true;
  }
  return false;
}
}  // namespace

// Large blocks live in mappings of their own; a freed one is kept for the next block of its
// length, and kept ones are returned to the kernel before the mappings would outgrow the most
// ever live at once.
TEST(TensorAllocator, MapsLargeBlocksAndKeepsThemForTheNextOfTheirLength) {
  install_tensor_allocator();
  const int64_t before = tensor_bytes().live;
  const void* address = nullptr;
  {
    torch::Tensor big = torch::arange(16 << 20, torch::kFloat);  // 64 MiB
    address = big.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(address) % c10::gAlignment, 0u);
    EXPECT_EQ(tensor_bytes().live - before, int64_t{64} << 20);
    EXPECT_TRUE(mapped(address));
    EXPECT_EQ(big[(16 << 20) - 1].item<float>(), static_cast<float>((16 << 20) - 1));
  }
  EXPECT_EQ(tensor_bytes().live, before);
  const TensorBytes freed = tensor_bytes();
  EXPECT_GE(freed.mapped - freed.mapped_live, int64_t{64} << 20) << "the freed block's mapping is kept";
  EXPECT_TRUE(mapped(address));
  {
    // The same length again: the kept mapping, its memory still there.
    const torch::Tensor again = torch::empty({16 << 20}, torch::kFloat);
    EXPECT_EQ(again.data_ptr(), address);
  }
  {
    // A length that the mappings ever live at once (earlier tests of this process included) do
    // not leave room for beside the kept one, which goes back to the kernel: twice the length,
    // or more after a larger peak.
    const int64_t room = std::max<int64_t>(0, freed.mapped_peak_live - freed.mapped);
    const int64_t floats = std::max<int64_t>(32 << 20, (room >> 2) + (1 << 20));
    const torch::Tensor bigger = torch::ones({floats}, torch::kFloat);
    const TensorBytes now = tensor_bytes();
    EXPECT_LE(now.mapped - now.mapped_live, freed.mapped - freed.mapped_live - (int64_t{64} << 20))
        << "the kept mapping was not returned";
    // Its address is unmapped, or the kernel gave it to the new block.
    const auto* first = static_cast<const char*>(bigger.data_ptr());
    const auto* kept = static_cast<const char*>(address);
    EXPECT_TRUE(!mapped(address) || (kept >= first && kept < first + floats * 4)) << "the kept mapping was not returned";
    EXPECT_EQ(bigger.sum().item<double>(), static_cast<double>(floats));
    EXPECT_GE(now.mapped_live, int64_t{128} << 20);
    EXPECT_LE(now.mapped, now.mapped_live + freed.mapped - freed.mapped_live);
  }
}

}  // namespace
}  // namespace moeplan::executor
