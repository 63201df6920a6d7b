// The live-tensor counter behind report.json's peak_tensor_bytes_per_rank.

#include "moeplan/executor/runtime.h"

#include <gtest/gtest.h>
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

}  // namespace
}  // namespace moeplan::executor
