// The executor on a CUDA GPU: where a rank computes, the one-rank trainer's step on the GPU
// against the same step on the CPU, the kernels' GPU paths, and the caching allocator's figures.
// The GPU tests skip, saying so, where this machine has no CUDA device.

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/executor/model/kernels.h"
#include "moeplan/executor/ranks/collectives.h"
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

// A 2-rank plan of a GPU profile where there is no GPU: the ranks agree on the CPU and gloo
// through the store, rank 0 says so once, and the run trains and reports where it ran.
TEST(ComputeDevice, GpuPlanOfTwoRanksWithoutAGpuTrainsOnCpuRanksAndSaysSo) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  const auto files = test::fortune_files({"wisdom"});
  if (files.empty()) GTEST_SKIP() << "needs Debian's fortunes package";
  const test::TempDir tmp;
  ASSERT_EQ(test::prepare_data(files, tmp.file("data"), 512, 64).exit_code, 0);
  const std::string model = test::write_small_model(tmp, 512), plan = tmp.file("plan.json");
  const test::Command s = test::run_moeplan(
      "search --gpus 2 --instance p5.48xlarge --model " + model + " --seq-len 64 --global-batch-tokens 256"
      " --precision fp32 --micro-batch 1 --expert-parallel-degree 2 --hybrid-shard-degree 1 --tensor-parallel-degree 1"
      " --pipeline-parallel-degree 1 --checkpointing none --offload off --target moeplan --out " + plan);
  ASSERT_EQ(s.exit_code, 0) << test::show(s);
  const test::Command r =
      test::run_moeplan("run " + plan + " --data " + tmp.file("data") + " --out " + tmp.file("run") + " --steps 2");
  ASSERT_EQ(r.exit_code, 0) << test::show(r);
  const std::string said = "the plan is for H100-SXM5-80GB GPUs (p5.48xlarge), but this machine has no CUDA device: "
                           "2 ranks train on the CPU, joined by gloo\n";
  const size_t at = r.all().find(said);
  EXPECT_NE(at, std::string::npos) << r.all();
  EXPECT_EQ(r.all().find(said, at + 1), std::string::npos) << "said once: " << r.all();
  const Json report = read_json_file(tmp.file("run/report.json"));
  EXPECT_EQ(report["measured"]["where"], "CPU ranks (gloo, started by moeplan)");
}

TEST(ComputeDevice, CpuCallsAreHarmless) {
  wait_for(torch::kCPU);
  reset_device_peaks(torch::kCPU);
  const DeviceMemory m = device_memory(torch::kCPU);
  EXPECT_EQ(m.peak_reserved, 0);
  EXPECT_EQ(m.used, 0);
}

// Where ranks compute, from what they see: every case of the choice, on any machine.
TEST(RankPlacement, EachRankTakesItsOwnGpuOrSharesOrStaysOnTheCpu) {
  // A CPU profile: the CPU, nothing to say.
  const RankPlace cpu = place_rank(DeviceKind::kCpu, 3, 8, true);
  EXPECT_EQ(cpu.gpu, -1);
  EXPECT_EQ(cpu.note, "");
  // A GPU profile where there is no GPU, or no CUDA in this build: the CPU, saying why.
  const RankPlace none = place_rank(DeviceKind::kCuda, 0, 0, true);
  EXPECT_EQ(none.gpu, -1);
  EXPECT_EQ(none.note, "this machine has no CUDA device");
  EXPECT_EQ(place_rank(DeviceKind::kCuda, 0, 8, false).note, "this moeplan was built with a LibTorch without CUDA");
  // One GPU per rank: local rank r on GPU r.
  for (int64_t r = 0; r < 8; ++r) {
    const RankPlace own = place_rank(DeviceKind::kCuda, r, 8, true);
    EXPECT_EQ(own.gpu, r);
    EXPECT_TRUE(own.own_gpu);
    EXPECT_EQ(own.note, "");
  }
  // More ranks than GPUs: round robin, shared, said.
  const RankPlace third = place_rank(DeviceKind::kCuda, 3, 2, true);
  EXPECT_EQ(third.gpu, 1);
  EXPECT_FALSE(third.own_gpu);
  EXPECT_EQ(third.note, "local rank 3 shares GPU 1 (2 here)");
  EXPECT_TRUE(place_rank(DeviceKind::kCuda, 1, 2, true).own_gpu);
}

TEST(RankPlacement, NcclOnlyWhenEveryRankHasAGpuOfItsOwn) {
  auto places = [](DeviceKind kind, int64_t ranks, int64_t gpus) {
    std::vector<RankPlace> all;
    for (int64_t r = 0; r < ranks; ++r) all.push_back(place_rank(kind, r, gpus, true));
    return all;
  };
  const std::vector<RankPlace> eight = places(DeviceKind::kCuda, 8, 8);
  EXPECT_EQ(choose_backend(eight, true), GroupBackend::kNccl);
  EXPECT_EQ(describe_placement(eight, GroupBackend::kNccl), "");
  // A build without NCCL keeps gloo and says so.
  EXPECT_EQ(choose_backend(eight, false), GroupBackend::kGloo);
  EXPECT_EQ(describe_placement(eight, GroupBackend::kGloo),
            "8 ranks on GPUs of their own, but this moeplan has no NCCL: their groups use gloo, staged through host "
            "memory");
  // Four ranks on one GPU (a workstation, a test): gloo over CUDA tensors.
  const std::vector<RankPlace> shared = places(DeviceKind::kCuda, 4, 1);
  EXPECT_EQ(choose_backend(shared, true), GroupBackend::kGloo);
  EXPECT_EQ(describe_placement(shared, GroupBackend::kGloo),
            "4 ranks share 1 GPU: their groups use gloo over CUDA tensors, staged through host memory (NCCL needs a "
            "GPU per rank)");
  // One rank without a GPU of its own is enough for gloo everywhere: one backend for the world.
  std::vector<RankPlace> mixed = eight;
  mixed.push_back(place_rank(DeviceKind::kCuda, 8, 8, true));
  EXPECT_EQ(choose_backend(mixed, true), GroupBackend::kGloo);
  // CPU ranks: gloo; a CPU profile says nothing, a GPU profile without GPUs says why.
  EXPECT_EQ(choose_backend(places(DeviceKind::kCpu, 2, 8), true), GroupBackend::kGloo);
  EXPECT_EQ(describe_placement(places(DeviceKind::kCpu, 2, 8), GroupBackend::kGloo), "");
  EXPECT_EQ(describe_placement(places(DeviceKind::kCuda, 2, 0), GroupBackend::kGloo),
            "this machine has no CUDA device: 2 ranks train on the CPU, joined by gloo");
  EXPECT_EQ(choose_backend({}, true), GroupBackend::kGloo);
}

// Every rank tells its place through the store and reads the others': all end with the same
// list, in rank order, whatever order they came in.
TEST(RankPlacement, EveryRankLearnsEveryPlaceThroughTheStore) {
  constexpr int64_t kRanks = 4;
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(20));
  std::vector<std::vector<RankPlace>> seen(kRanks);
  std::vector<std::thread> ranks;
  for (int64_t r = kRanks - 1; r >= 0; --r)
    ranks.emplace_back([&, r] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20 * r));
      seen[static_cast<size_t>(r)] = places_of_world(*store, r, kRanks, place_rank(DeviceKind::kCuda, r, 3, true));
    });
  for (std::thread& t : ranks) t.join();
  for (int64_t r = 0; r < kRanks; ++r) {
    const std::vector<RankPlace>& all = seen[static_cast<size_t>(r)];
    ASSERT_EQ(all.size(), static_cast<size_t>(kRanks)) << "rank " << r;
    for (int64_t q = 0; q < kRanks; ++q) {
      const RankPlace want = place_rank(DeviceKind::kCuda, q, 3, true);
      EXPECT_EQ(all[static_cast<size_t>(q)].gpu, want.gpu) << "rank " << r << " about rank " << q;
      EXPECT_EQ(all[static_cast<size_t>(q)].own_gpu, want.own_gpu) << "rank " << r << " about rank " << q;
      EXPECT_EQ(all[static_cast<size_t>(q)].note, want.note) << "rank " << r << " about rank " << q;
    }
  }
  EXPECT_EQ(choose_backend(seen[0], true), GroupBackend::kGloo) << "rank 3 shares GPU 0";
}

using test::tiny_plan;

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

// Which expert kernel a trainer runs unless told: the grouped one on a GPU in mixed precision
// with widths the kernel can align, one multiply per expert otherwise.
TEST(ExpertKernelChoice, GroupedOnAGpuInMixedPrecisionWithAlignedWidths) {
  const ModelSpec spec = test::model("mixtral-tiny");
  const torch::Device cpu(torch::kCPU), cuda(torch::kCUDA, 0);
  const auto kAuto = ExpertKernel::kAuto;
  const torch::ScalarType fp32 = torch::kFloat, bf16 = torch::kBFloat16;
  EXPECT_EQ(resolve_expert_kernel(kAuto, spec, cuda, fp32, bf16), ExpertKernel::kGrouped);
  EXPECT_EQ(resolve_expert_kernel(kAuto, spec, cpu, fp32, bf16), ExpertKernel::kPerExpert);
  EXPECT_EQ(resolve_expert_kernel(kAuto, spec, cuda, fp32, fp32), ExpertKernel::kPerExpert);
  EXPECT_EQ(resolve_expert_kernel(kAuto, spec, cuda, bf16, bf16), ExpertKernel::kPerExpert) << "no copies to stack";
  ModelSpec odd = spec;
  odd.intermediate_size = 100;  // 200 bytes a row in bf16: no multiple of 16
  EXPECT_EQ(resolve_expert_kernel(kAuto, odd, cuda, fp32, bf16), ExpertKernel::kPerExpert);
  EXPECT_EQ(resolve_expert_kernel(ExpertKernel::kGrouped, spec, cpu, fp32, fp32), ExpertKernel::kGrouped);
}

// Trainers on one device, one with the grouped kernel over stacked experts and one with a
// multiply per expert, from the same parameters: the same routing, and losses, gradient norms
// and parameters within the compute type's rounding, over two steps of two micro-batches.
void expect_expert_kernels_agree(const torch::Device& device, Precision precision, double rtol) {
  const Plan plan = tiny_plan(precision);
  ModelTrainer grouped(plan, device, ExpertKernel::kGrouped), each(plan, device, ExpertKernel::kPerExpert);
  ASSERT_EQ(grouped.expert_kernel(), ExpertKernel::kGrouped);
  torch::manual_seed(9);
  for (int step = 0; step < 2; ++step) {
    std::vector<torch::Tensor> batches;
    for (int m = 0; m < 2; ++m) batches.push_back(torch::randint(plan.model.vocab_size, {2, 64}, torch::kLong));
    const StepRecord a = each.step(batches), b = grouped.step(batches);
    EXPECT_NEAR(a.loss, b.loss, rtol * a.loss) << "step " << step;
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 10 * rtol * a.grad_norm) << "step " << step;
    if (precision == Precision::kFp32) {
      EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert) << "step " << step;
    }
  }
  // AdamW moves an element by about the learning rate whatever its gradient's size, so the
  // elements whose gradient is near zero may move apart by up to twice that a step (a sign the
  // rounding turns); all but a few elements stay within the rounding.
  const double adam_step = plan.training.learning_rate;
  int64_t elements = 0, apart = 0;
  for (size_t i = 0; i < each.parameters().tensors().size(); ++i) {
    const torch::Tensor a = each.parameters().tensors()[i].detach().cpu().to(torch::kDouble);
    const torch::Tensor b = grouped.parameters().tensors()[i].detach().cpu().to(torch::kDouble);
    const torch::Tensor difference = (a - b).abs();
    // bf16 weights (Precision::kBf16) are also a unit in the last place apart: 2^-7 of the value.
    const double ulp = each.parameters().tensors()[i].scalar_type() == torch::kBFloat16 ? 1.0 / 128 : 0;
    EXPECT_LE((difference - ulp * a.abs()).max().item<double>(), 4 * adam_step * 1.01)
        << each.parameters().infos()[i].name;
    elements += a.numel();
    apart += (difference > 1e-5 + 100 * rtol * a.abs()).sum().item<int64_t>();
  }
  std::cout << "  " << apart << " of " << elements << " parameter elements apart beyond the rounding\n";
  EXPECT_LE(static_cast<double>(apart), 1e-3 * static_cast<double>(elements));
}

TEST(ExpertKernelChoice, GroupedAndPerExpertTrainersAgreeOnTheCpu) {
  expect_expert_kernels_agree(torch::kCPU, Precision::kFp32, 1e-5);
  expect_expert_kernels_agree(torch::kCPU, Precision::kMixed, 1e-2);
  expect_expert_kernels_agree(torch::kCPU, Precision::kBf16, 1e-2);
}

TEST(Gpu, GroupedAndPerExpertTrainersAgree) {
  SKIP_WITHOUT_GPU();
  expect_expert_kernels_agree(torch::Device(torch::kCUDA, 0), Precision::kMixed, 1e-2);
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

// Each collective on a process group of one on the GPU, through NCCL (its communicator on the
// device) and through gloo (CUDA tensors staged through host memory): every result is the rank's
// own data, back on the device, and every call went through the backend.
TEST(Gpu, OneRankGroupsRunEveryCollectiveOnTheDevice) {
  SKIP_WITHOUT_GPU();
  const torch::Device cuda(torch::kCUDA, 0);
  for (const bool nccl : {true, false}) {
    if (nccl && !nccl_built()) {
      ADD_FAILURE() << "this moeplan was built without NCCL";
      continue;
    }
    const std::string which = nccl ? "NCCL" : "gloo";
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto timeout = std::chrono::milliseconds(30000);
    BackendGroup group = nccl ? make_nccl_group(store, "one/", 0, 1, timeout, cuda)
                              : make_gloo_group(store, "one/", 0, 1, timeout);
    Communicator comm(std::move(group), which + " group of one", 0, cuda);
    EXPECT_EQ(comm.wire(), nccl ? cuda : torch::Device(torch::kCPU)) << which;
    int64_t observed = 0;
    comm.set_observer([&observed](const char*, int64_t, auto, auto) { ++observed; });
    for (const torch::ScalarType type : {torch::kFloat, torch::kBFloat16}) {
      const torch::Tensor want = torch::arange(15, torch::dtype(torch::kFloat).device(cuda)).view({3, 5}).to(type);
      auto same = [&](const torch::Tensor& got, const char* op) {
        EXPECT_TRUE(got.is_cuda()) << which << " " << op;
        EXPECT_TRUE(torch::equal(got.cpu(), want.cpu())) << which << " " << op;
      };
      torch::Tensor t = want.clone();
      comm.all_reduce_sum(t);
      same(t, "all-reduce");
      same(comm.all_gather(want), "all-gather");
      same(comm.reduce_scatter_sum(want), "reduce-scatter");
      same(comm.all_to_all(want, {3}, {3}), "all-to-all");
      comm.broadcast(t, 0);
      same(t, "broadcast");
      // A host tensor (counts, sums) on the same group comes back on the host.
      torch::Tensor counts = torch::ones({4}, torch::kLong);
      comm.all_reduce_sum(counts);
      EXPECT_TRUE(counts.device().is_cpu()) << which;
      EXPECT_TRUE(torch::equal(counts, torch::ones({4}, torch::kLong))) << which;
    }
    EXPECT_EQ(observed, 12) << which;
  }
}

// Ranks sharing this machine's GPU (gloo over CUDA tensors, one process a rank): layouts of 2 and
// 4 ranks train the same model to the one GPU rank's losses and routing, resume bit for bit, and
// keep each rank's peak device tensors within 10% of the memory model's. The text: the folder in
// MOEPLAN_GPU_TEST_DATA (`moeplan data prepare --vocab-size 512 --block-size 64`), else the fortunes
// package prepared here.
struct GpuLayout {
  std::string name;
  int64_t ranks, e, s, t, p;
  std::string checkpointing = "none";
  bool offload = false;
};
void PrintTo(const GpuLayout& l, std::ostream* os) { *os << l.name; }

class GpuRanks : public ::testing::TestWithParam<GpuLayout> {
 protected:
  static constexpr int64_t kSteps = 20;
  static void SetUpTestSuite() {
    if (cuda_device_count() == 0) return;
    dir_ = new test::TempDir();
    if (const char* prepared = std::getenv("MOEPLAN_GPU_TEST_DATA")) {
      data_ = prepared;
    } else {
      const auto files = test::fortune_files({"fortunes", "wisdom", "science", "computers"});
      if (files.empty()) return;
      data_ = dir_->file("data");
      const test::Command r = test::prepare_data(files, data_, 512, 64);
      ASSERT_EQ(r.exit_code, 0) << test::show(r);
    }
    model_ = test::write_small_model(*dir_, 512);
    reference_ = train(plan({"one", 1, 1, 1, 1, 1}), "reference");
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    if (data_.empty()) GTEST_SKIP() << "needs MOEPLAN_GPU_TEST_DATA or Debian's fortunes package";
    ASSERT_EQ(reference_.size(), static_cast<size_t>(kSteps));
  }

  // The layout planned for p5.48xlarge's GPUs with its degrees pinned: one sequence of 64 tokens
  // a micro-batch, 4 of them a step; its memory as the executor keeps it (LibTorch's operations
  // one by one, scaled-dot-product attention), not as the profile's fused kernels would.
  static std::string plan(const GpuLayout& l) {
    const std::string out = dir_->file("plan-" + l.name + ".json");
    const test::Command s = test::run_moeplan(
        "search --gpus " + std::to_string(l.ranks) + " --instance p5.48xlarge --model " + model_ +
        " --seq-len 64 --global-batch-tokens 256 --precision fp32 --micro-batch 1 --target moeplan" +
        " --kernels eager --attention flash" +
        " --expert-parallel-degree " + std::to_string(l.e) + " --hybrid-shard-degree " + std::to_string(l.s) +
        " --tensor-parallel-degree " + std::to_string(l.t) + " --pipeline-parallel-degree " + std::to_string(l.p) +
        " --checkpointing " + l.checkpointing + " --offload " + (l.offload ? "on" : "off") + " --out " + out);
    EXPECT_EQ(s.exit_code, 0) << test::show(s);
    return out;
  }
  static std::vector<Json> train(const std::string& plan, const std::string& name, const std::string& more = "") {
    const test::Command r = test::run_moeplan("run " + plan + " --data " + data_ + " --out " + dir_->file(name) +
                                              " --steps " + std::to_string(kSteps) + " --timeout 120" + more);
    EXPECT_EQ(r.exit_code, 0) << test::show(r);
    return test::read_metrics(dir_->file(name));
  }

  static test::TempDir* dir_;
  static std::string data_, model_;
  static std::vector<Json> reference_;
};

test::TempDir* GpuRanks::dir_ = nullptr;
std::string GpuRanks::data_, GpuRanks::model_;
std::vector<Json> GpuRanks::reference_;

TEST_P(GpuRanks, TrainLikeOneGpuRankAndResumeBitForBit) {
  const GpuLayout& l = GetParam();
  const std::string plan_file = plan(l);
  const std::vector<Json> m = train(plan_file, "run-" + l.name);
  ASSERT_EQ(m.size(), static_cast<size_t>(kSteps));
  for (size_t i = 0; i < m.size(); ++i) {
    const double a = reference_[i]["loss"].get<double>(), b = m[i]["loss"].get<double>();
    EXPECT_LE(std::abs(b - a), 1e-4 * std::abs(a))
        << "step " << i + 1 << ": one rank " << a << ", " << l.name << " " << b;
    EXPECT_EQ(m[i]["tokens_per_expert"], reference_[i]["tokens_per_expert"]) << "step " << i + 1;
  }
  const Json report = read_json_file(dir_->file("run-" + l.name + "/report.json"));
  EXPECT_NE(report["measured"]["where"].get<std::string>().find("GPU ranks (gloo"), std::string::npos)
      << report["measured"]["where"];
  // Each rank's peak device tensors (the caching allocator's peak allocated, less cuBLAS's
  // workspaces) against the memory model's tensors (its device bytes less the framework's fixed
  // overhead, where the workspaces are counted, and fragmentation).
  const Json planned = read_json_file(plan_file);
  double predicted = 0;
  for (const auto& [item, bytes] : planned["prediction"]["memory"]["device"].items())
    if (item != "framework_overhead" && item != "fragmentation") predicted += bytes.get<double>();
  const Json& peaks = report["measured"]["peak_device_allocated_bytes_per_rank"];
  const Json& workspaces = report["measured"]["device_workspace_bytes_per_rank"];
  ASSERT_EQ(peaks.size(), static_cast<size_t>(l.ranks));
  ASSERT_EQ(workspaces.size(), static_cast<size_t>(l.ranks));
  for (size_t r = 0; r < peaks.size(); ++r) {
    const double tensors = peaks[r].get<double>() - workspaces[r].get<double>();
    EXPECT_NEAR(tensors / predicted, 1.0, 0.1)
        << "rank " << r << ": " << peaks[r].get<double>() << " bytes allocated at the peak, "
        << workspaces[r].get<double>() << " of them cuBLAS's workspaces, " << predicted << " predicted";
  }
  // Stopped after 10 steps with a checkpoint and resumed: steps 11 to 20 as the whole run's, bit for bit.
  const std::string half = "half-" + l.name;
  const test::Command first = test::run_moeplan("run " + plan_file + " --data " + data_ + " --out " + dir_->file(half) +
                                                " --steps 10 --checkpoint-every 10 --timeout 120");
  ASSERT_EQ(first.exit_code, 0) << test::show(first);
  const std::vector<Json> resumed = train(plan_file, half, " --resume");
  ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps));
  for (size_t i = 10; i < resumed.size(); ++i)
    EXPECT_EQ(resumed[i]["loss"].get<double>(), m[i]["loss"].get<double>()) << "step " << i + 1 << " after resuming";
}

// A NaN in one weight of layer 1, planted in a checkpoint: GPU ranks skip every step from there
// on and the third in a row stops the run naming layer 1, as CPU ranks do (Faults in
// faults_test.cc). On the layout with experts and shards over ranks.
TEST_P(GpuRanks, ANanWeightSkipsStepsThenStopsNamingTheLayer) {
  const GpuLayout& l = GetParam();
  if (l.e < 2 || l.s < 2) GTEST_SKIP() << "run on the layout with experts and shards both over ranks";
  const std::string plan_file = plan(l), out = dir_->file("nan-" + l.name);
  test::Command r = test::run_moeplan("run " + plan_file + " --data " + data_ + " --out " + out +
                                      " --steps 2 --checkpoint-every 2 --timeout 120");
  ASSERT_EQ(r.exit_code, 0) << test::show(r);
  ASSERT_GT(test::plant_nan(out + "/checkpoints/step-00000002", "model.layers.1.self_attn.q_proj.weight"), 0);
  r = test::run_moeplan("run " + plan_file + " --data " + data_ + " --out " + out +
                        " --steps 10 --resume --max-nonfinite-steps 3 --timeout 120");
  EXPECT_EQ(r.exit_code, 1) << test::show(r);
  EXPECT_NE(r.err.find("steps 3..5 had a NaN or an Inf in the loss or the gradients, 3 in a row"), std::string::npos)
      << test::show(r);
  EXPECT_NE(r.err.find("first appeared in the parameters of layer 1"), std::string::npos) << test::show(r);
  EXPECT_EQ(test::read_metrics(out).size(), 5u);
}

INSTANTIATE_TEST_SUITE_P(SharingOneGpu, GpuRanks,
                         ::testing::Values(GpuLayout{"E2", 2, 2, 1, 1, 1}, GpuLayout{"S2", 2, 1, 2, 1, 1},
                                           GpuLayout{"T2", 2, 1, 1, 2, 1}, GpuLayout{"P2", 2, 1, 1, 1, 2},
                                           GpuLayout{"E2-offload", 2, 2, 1, 1, 1, "full", true},
                                           GpuLayout{"E2S2", 4, 2, 2, 1, 1}),
                         [](const ::testing::TestParamInfo<GpuLayout>& info) {
                           std::string n = info.param.name;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace moeplan::executor
