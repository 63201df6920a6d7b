// AdamW, clipping and the schedule against values worked by hand.

#include <gtest/gtest.h>

#include <cmath>

#include "moeplan/executor/training/optimizer.h"

namespace moeplan::executor {
namespace {

TEST(AdamW, FirstTwoStepsByHand) {
  torch::Tensor p = torch::tensor({1.0f, -2.0f});
  AdamW opt({p}, {true}, AdamWSettings{0.9, 0.95, 1e-8, 0.1});
  opt.step({torch::tensor({0.5f, 0.5f})}, 0.01);
  // Step 1: decay p *= 1 - 0.01*0.1; m = 0.05, v = 0.0125; m_hat = 0.5, v_hat = 0.25;
  // update = lr * 0.5 / (0.5 + 1e-8) = 0.01 (to 1e-8).
  EXPECT_NEAR(p[0].item<double>(), 1.0 * 0.999 - 0.01, 1e-6);
  EXPECT_NEAR(p[1].item<double>(), -2.0 * 0.999 - 0.01, 1e-6);
  opt.step({torch::tensor({-1.0f, 0.0f})}, 0.01);
  // Step 2, element 0: m = 0.9*0.05 - 0.1 = -0.055; v = 0.95*0.0125 + 0.05*1 = 0.061875;
  // m_hat = -0.055/0.19, v_hat = 0.061875/0.0975; update = -lr * m_hat / sqrt(v_hat).
  const double p1 = (1.0 * 0.999 - 0.01) * 0.999;
  const double m_hat = -0.055 / (1 - 0.81), v_hat = 0.061875 / (1 - 0.9025);
  EXPECT_NEAR(p[0].item<double>(), p1 - 0.01 * m_hat / (std::sqrt(v_hat) + 1e-8), 1e-6);
  EXPECT_EQ(opt.step_count(), 2);
}

TEST(AdamW, NoDecayForNormWeights) {
  torch::Tensor p = torch::tensor({1.0f});
  AdamW opt({p}, {false}, AdamWSettings{0.9, 0.95, 1e-8, 0.5});
  opt.step({torch::tensor({0.0f})}, 0.1);
  EXPECT_FLOAT_EQ(p[0].item<float>(), 1.0f);
}

TEST(ClipGradNorm, ScalesToMaxNormOverAllTensors) {
  // Norm of (3, 4) and (12) is sqrt(9 + 16 + 144) = 13.
  torch::Tensor a = torch::tensor({3.0f, 4.0f}), b = torch::tensor({12.0f});
  EXPECT_NEAR(clip_grad_norm({a, b}, 1.0), 13.0, 1e-5);
  EXPECT_NEAR(a[0].item<double>(), 3.0 / (13 + 1e-6), 1e-6);
  EXPECT_NEAR(b[0].item<double>(), 12.0 / (13 + 1e-6), 1e-6);
  // Under the limit nothing changes.
  torch::Tensor c = torch::tensor({0.3f});
  EXPECT_NEAR(clip_grad_norm({c}, 1.0), 0.3, 1e-6);
  EXPECT_FLOAT_EQ(c[0].item<float>(), 0.3f);
}

TEST(Schedule, WarmupThenCosine) {
  TrainingConfig t;
  t.learning_rate = 1e-3;
  t.min_learning_rate = 1e-4;
  t.warmup_steps = 10;
  t.steps = 110;
  EXPECT_DOUBLE_EQ(learning_rate(t, 1), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(t, 10), 1e-3);
  EXPECT_NEAR(learning_rate(t, 60), 1e-4 + 0.5 * 9e-4, 1e-12);  // halfway: cos(pi/2) = 0
  EXPECT_NEAR(learning_rate(t, 110), 1e-4, 1e-12);
  EXPECT_NEAR(learning_rate(t, 500), 1e-4, 1e-12);  // stays at the floor
}

}  // namespace
}  // namespace moeplan::executor
