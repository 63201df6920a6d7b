// The executor on a CUDA GPU: where a rank computes, the one-rank trainer's step on the GPU
// against the same step on the CPU, the kernels' GPU paths, and the caching allocator's figures.
// The GPU tests skip, saying so, where this machine has no CUDA device.

#include <gtest/gtest.h>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/executor/model/kernels.h"
#include "moeplan/executor/ranks/device.h"
#include "moeplan/executor/training/trainer.h"
#include "run_fixture.h"
#include "test_support.h"

namespace moeplan::executor {
namespace {

ClusterSpec profile(const std::string& name) { return read_cluster_file(test::profile_path("hardware/" + name + ".json")); }

#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU: " << choose_device(profile("p5.48xlarge"), 0).note

TEST(ComputeDevice, CpuProfileComputesOnTheCpu) {
  const ComputeDevice d = choose_device(profile("local-cpu"), 0);
  EXPECT_TRUE(d.device.is_cpu());
  EXPECT_EQ(d.note, "");
}

TEST(ComputeDevice, GpuProfileTakesTheLocalRanksGpuOrSaysWhyNot) {
  const ClusterSpec p5 = profile("p5.48xlarge");
  const int64_t gpus = cuda_device_count();
  const ComputeDevice first = choose_device(p5, 0);
  if (gpus == 0) {
    EXPECT_TRUE(first.device.is_cpu());
    EXPECT_NE(first.note.find("no CUDA device"), std::string::npos) << first.note;
  } else {
    EXPECT_EQ(first.device, torch::Device(torch::kCUDA, 0));
    EXPECT_EQ(first.note, "");
  }
  // A local rank past the GPUs here stays on the CPU and says so.
  const ComputeDevice past = choose_device(p5, gpus + 1);
  EXPECT_TRUE(past.device.is_cpu());
  EXPECT_FALSE(past.note.empty());
}

// Calibrating with a GPU profile as the base needs the GPU: without one, an error naming
// --base and a non-zero exit, before anything is measured or written.
TEST(ComputeDevice, GpuCalibrationWithoutAGpuSaysSo) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  const test::TempDir tmp;
  const test::Command c = test::run_moeplan("calibrate --ranks 1 --base p5.48xlarge --model mixtral-tiny --out " +
                                            tmp.file("gpu.json"));
  EXPECT_EQ(c.exit_code, 2) << c.all();
  EXPECT_NE(c.err.find("--base: p5.48xlarge is a GPU profile, but this machine has no CUDA device"), std::string::npos)
      << c.err;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("gpu.json")));
}

TEST(ComputeDevice, CpuCallsAreHarmless) {
  wait_for(torch::kCPU);
  reset_device_peaks(torch::kCPU);
  const DeviceMemory m = device_memory(torch::kCPU);
  EXPECT_EQ(m.peak_reserved, 0);
  EXPECT_EQ(m.used, 0);
}

Plan tiny_plan(Precision precision) {
  Plan plan;
  plan.model = test::model("mixtral-tiny");
  plan.training.seq_len = 64;
  plan.training.precision = precision;
  plan.training.steps = 10;
  plan.training.warmup_steps = 0;
  plan.parallel.micro_batch_size = 2;
  plan.parallel.gradient_accumulation_steps = 2;
  plan.moe.load_balancing = LoadBalancing::kAuxLoss;
  return plan;
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double rtol, double atol, const std::string& what) {
  const torch::Tensor x = a.detach().cpu().to(torch::kDouble), y = b.detach().cpu().to(torch::kDouble);
  ASSERT_EQ(x.sizes(), y.sizes()) << what;
  EXPECT_TRUE(torch::allclose(x, y, rtol, atol)) << what << ": largest difference " << (x - y).abs().max().item<double>();
}

// Two optimizer steps of two micro-batches each, on the CPU and on the GPU from the same
// parameters: the same losses, gradient norms and parameters, within fp32 rounding (TF32 is
// off in LibTorch by default).
TEST(Gpu, TrainerStepsMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  const Plan plan = tiny_plan(Precision::kFp32);
  ModelTrainer cpu(plan, torch::kCPU), gpu(plan, torch::Device(torch::kCUDA, 0));
  EXPECT_TRUE(gpu.parameters().tensors().front().is_cuda());
  torch::manual_seed(7);
  for (int step = 0; step < 2; ++step) {
    std::vector<torch::Tensor> batches;
    for (int m = 0; m < 2; ++m) batches.push_back(torch::randint(plan.model.vocab_size, {2, 64}, torch::kLong));
    const StepRecord a = cpu.step(batches), b = gpu.step(batches);
    EXPECT_NEAR(a.loss, b.loss, 1e-4 * a.loss) << "step " << step;
    EXPECT_NEAR(a.aux_loss, b.aux_loss, 1e-4 * a.aux_loss) << "step " << step;
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-3 * a.grad_norm) << "step " << step;
    EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert) << "step " << step;
  }
  for (size_t i = 0; i < cpu.parameters().tensors().size(); ++i)
    expect_close(cpu.parameters().tensors()[i], gpu.parameters().tensors()[i], 1e-3, 1e-5,
                 cpu.parameters().infos()[i].name);
  // A checkpoint's state comes back on the host.
  for (const auto& [name, t] : gpu.state()) EXPECT_TRUE(t.device().is_cpu()) << name;
}

// Mixed precision (bf16 compute, fp32 master weights) on the GPU: the losses follow the CPU's
// within bf16's rounding, and the caching allocator saw at least the master weights, their
// moments and gradients.
TEST(Gpu, MixedPrecisionStepAndAllocatorPeaks) {
  SKIP_WITHOUT_GPU();
  const torch::Device cuda(torch::kCUDA, 0);
  const Plan plan = tiny_plan(Precision::kMixed);
  ModelTrainer cpu(plan, torch::kCPU), gpu(plan, cuda);
  reset_device_peaks(cuda);
  torch::manual_seed(8);
  std::vector<torch::Tensor> batches;
  for (int m = 0; m < 2; ++m) batches.push_back(torch::randint(plan.model.vocab_size, {2, 64}, torch::kLong));
  const StepRecord a = cpu.step(batches), b = gpu.step(batches);
  EXPECT_NEAR(a.loss, b.loss, 2e-2 * a.loss);
  EXPECT_NEAR(a.grad_norm, b.grad_norm, 5e-2 * a.grad_norm);
  int64_t params = 0;
  for (const torch::Tensor& t : gpu.parameters().tensors()) params += t.numel();
  const DeviceMemory m = device_memory(cuda);
  EXPECT_GE(m.peak_allocated, params * 4 * 4) << "fp32 weights, two moments and fp32 gradients";
  EXPECT_GE(m.peak_reserved, m.peak_allocated);
  EXPECT_GT(m.used, m.reserved) << "the CUDA context holds memory beyond the allocator's";
  EXPECT_GT(m.total, m.used);
}

// The kernels' GPU paths (LibTorch's RMSNorm, the rotary chain, scaled-dot-product attention)
// against the CPU's fused kernels.
TEST(Gpu, KernelsMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  const torch::Device cuda(torch::kCUDA, 0);
  torch::manual_seed(9);
  const torch::Tensor x = torch::randn({2, 48, 96}), w = torch::randn({96});
  expect_close(fused_rms_norm(x, w, 1e-5), fused_rms_norm(x.to(cuda), w.to(cuda), 1e-5), 1e-5, 1e-5, "rms_norm");
  const torch::Tensor q = torch::randn({2, 48, 4, 32}), cos = torch::randn({48, 32}), sin = torch::randn({48, 32});
  expect_close(fused_rotary(q, cos, sin), fused_rotary(q.to(cuda), cos.to(cuda), sin.to(cuda)), 1e-5, 1e-5, "rotary");
  for (const torch::ScalarType type : {torch::kFloat, torch::kBFloat16}) {
    const torch::Tensor qh = torch::randn({2, 4, 48, 32}).to(type), k = torch::randn({2, 2, 48, 32}).to(type),
                        v = torch::randn({2, 2, 48, 32}).to(type);
    const double tol = type == torch::kFloat ? 1e-4 : 2e-2;
    expect_close(flash_attention(qh, k, v, {}), flash_attention(qh.to(cuda), k.to(cuda), v.to(cuda), {}), tol, tol,
                 std::string("attention ") + c10::toString(type));
  }
}

}  // namespace
}  // namespace moeplan::executor
