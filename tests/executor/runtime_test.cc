// The live-tensor counter behind report.json's peak_tensor_bytes_per_rank.

#include "moeplan/executor/runtime.h"

#include <gtest/gtest.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

namespace moeplan::executor {
namespace {

TEST(TensorBytes, CountsLiveTensorsAndKeepsThePeak) {
  count_tensor_bytes();
  count_tensor_bytes();  // a second call changes nothing
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

// Some kernels take raw memory from the CPU allocator (raw_allocate), which requires the data
// pointer to be its own context; the counter must serve them and count them.
TEST(TensorBytes, ServesRawAllocations) {
  count_tensor_bytes();
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

}  // namespace
}  // namespace moeplan::executor
