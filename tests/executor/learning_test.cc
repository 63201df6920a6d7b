// Training on real text learns something: a slow test through the real binary.

#include <gtest/gtest.h>

#include <cstdio>

#include "run_fixture.h"

namespace moeplan::test {
namespace {

// The model learns more than token frequencies: on real text its loss falls well below the
// corpus's unigram entropy, the best a model that ignores context can reach.
TEST(Learning, LossFallsBelowTheUnigramEntropyOfRealText) {
  TempDir dir;
  const auto files = fortune_files({"fortunes", "wisdom", "science", "computers", "people", "literature"});
  if (files.empty()) GTEST_SKIP() << "needs Debian's fortunes package (" << kFortunesDir << ")";
  ASSERT_EQ(prepare_data(files, dir.file("data"), 512, 64).exit_code, 0);
  const double entropy = read_json_file(dir.file("data/manifest.json"))["unigram_entropy_nats"].get<double>();
  const std::string model = write_small_model(dir, 512), plan = dir.file("plan.json");
  const Command made = run_moeplan("search --gpus 1 --instance local-cpu --model " + model +
                                   " --seq-len 64 --global-batch-tokens 1024 --precision fp32 --max-micro-batch 16"
                                   " --steps 150 --learning-rate 3e-3 --min-learning-rate 3e-4 --warmup-steps 10"
                                   " --out " + plan);
  ASSERT_EQ(made.exit_code, 0) << show(made);
  const Command run = run_moeplan("run " + plan + " --data " + dir.file("data") + " --out " + dir.file("run"));
  ASSERT_EQ(run.exit_code, 0) << show(run);
  const std::vector<Json> metrics = read_metrics(dir.file("run"));
  ASSERT_EQ(metrics.size(), 150u);
  double last = 0;
  for (size_t i = metrics.size() - 10; i < metrics.size(); ++i) last += metrics[i]["loss"].get<double>() / 10;
  std::printf("unigram entropy %.3f nats, first loss %.3f, mean of the last 10 steps %.3f\n", entropy,
              metrics.front()["loss"].get<double>(), last);
  EXPECT_LT(last, entropy - 0.5);
}

}  // namespace
}  // namespace moeplan::test
