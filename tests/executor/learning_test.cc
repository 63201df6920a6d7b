// Training on real text learns something: a slow test through the real binary.

#include <gtest/gtest.h>

#include <cstdio>
#include <utility>

#include "run_fixture.h"

namespace moeplan::test {
namespace {

// Trains `profile` (a shipped tiny model at a 512-piece vocabulary) 150 steps of 1,024 tokens on
// `gpus` CPU ranks with the search's `extra` pins; returns the unigram entropy and the mean loss
// of the last 10 steps.
std::pair<double, double> train_on_fortunes(const std::string& profile, int64_t gpus, const std::string& extra) {
  TempDir dir;
  const auto files = fortune_files({"fortunes", "wisdom", "science", "computers", "people", "literature"});
  if (files.empty()) return {0, 0};
  EXPECT_EQ(prepare_data(files, dir.file("data"), 512, 64).exit_code, 0);
  const double entropy = read_json_file(dir.file("data/manifest.json"))["unigram_entropy_nats"].get<double>();
  const std::string model = write_small_model(dir, 512, profile), plan = dir.file("plan.json");
  const Command made = run_moeplan("search --gpus " + std::to_string(gpus) + " --instance local-cpu --model " + model +
                                   " --seq-len 64 --global-batch-tokens 1024 --precision fp32 --max-micro-batch 16"
                                   " --steps 150 --learning-rate 3e-3 --min-learning-rate 3e-4 --warmup-steps 10 " +
                                   extra + " --out " + plan);
  EXPECT_EQ(made.exit_code, 0) << show(made);
  const Command run = run_moeplan("run " + plan + " --data " + dir.file("data") + " --out " + dir.file("run"));
  EXPECT_EQ(run.exit_code, 0) << show(run);
  const std::vector<Json> metrics = read_metrics(dir.file("run"));
  EXPECT_EQ(metrics.size(), 150u);
  if (metrics.size() < 10) return {entropy, entropy};
  double last = 0;
  for (size_t i = metrics.size() - 10; i < metrics.size(); ++i) last += metrics[i]["loss"].get<double>() / 10;
  std::printf("%s on %lld rank(s): unigram entropy %.3f nats, first loss %.3f, mean of the last 10 steps %.3f\n",
              profile.c_str(), static_cast<long long>(gpus), entropy, metrics.front()["loss"].get<double>(), last);
  return {entropy, last};
}

// The model learns more than token frequencies: on real text its loss falls well below the
// corpus's unigram entropy, the best a model that ignores context can reach.
TEST(Learning, LossFallsBelowTheUnigramEntropyOfRealText) {
  if (fortune_files({"fortunes"}).empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
  const auto [entropy, last] = train_on_fortunes("mixtral-tiny", 1, "");
  EXPECT_LT(last, entropy - 0.5);
}

// The same for Qwen3-MoE's blocks (qwen3-tiny: q/k norms, 32 experts, top-8) on two ranks with
// the experts split over them.
TEST(Learning, Qwen3LossFallsBelowTheUnigramEntropyOnTwoRanks) {
  if (fortune_files({"fortunes"}).empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
  const auto [entropy, last] = train_on_fortunes("qwen3-tiny", 2, "--expert-parallel-degree 2");
  EXPECT_LT(last, entropy - 0.5);
}

// The same for DeepSeek-V3's blocks (deepseek-v3-tiny: latent attention, a dense first block, a
// shared expert, the sigmoid router in groups with its balancing bias, multi-token prediction)
// on two ranks with the experts split over them.
TEST(Learning, DeepSeekV3LossFallsBelowTheUnigramEntropyOnTwoRanks) {
  if (fortune_files({"fortunes"}).empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
  const auto [entropy, last] = train_on_fortunes("deepseek-v3-tiny", 2, "--expert-parallel-degree 2");
  EXPECT_LT(last, entropy - 0.5);
}

}  // namespace
}  // namespace moeplan::test
