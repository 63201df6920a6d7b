// Reading other frameworks' training logs: samples in each framework's own line format
// (tests/data/logs), bad lines refused by number, foreign files refused by name.
#include "moeplan/core/training_log.h"

#include <gtest/gtest.h>

#include <string>

#include "moeplan/core/errors.h"
#include "test_support.h"

namespace moeplan {
namespace {

std::string sample(const std::string& name) { return test::read_text(test::data_path("logs/" + name)); }

// The error's lines, joined; empty when parsing succeeds.
std::string refusal(const std::string& text) {
  try {
    parse_training_log(text, "run.log");
  } catch (const InputError& e) {
    std::string all;
    for (const std::string& l : e.lines()) all += l + "\n";
    return all;
  }
  return "";
}

TEST(TrainingLog, ReadsMegatronIterationsMemoryAndTimers) {
  const TrainingLog log = read_training_log(test::data_path("logs/megatron.log"));
  EXPECT_EQ(log.format, LogFormat::kMegatron);
  ASSERT_EQ(log.iterations.size(), 4u);
  const LoggedIteration& second = log.iterations[1];
  EXPECT_EQ(second.line, 9);
  EXPECT_EQ(second.iteration, 2);
  EXPECT_DOUBLE_EQ(second.step_ms, 31020.0);
  EXPECT_DOUBLE_EQ(second.tflops_per_gpu, 160.1);
  EXPECT_EQ(second.global_batch, 2048);
  EXPECT_DOUBLE_EQ(second.loss, 9.871234);
  EXPECT_DOUBLE_EQ(log.max_allocated_bytes, 35123.5 * 1024 * 1024);
  const std::vector<double> fb = log.timer_max_ms.at("forward-backward");
  EXPECT_EQ(fb, (std::vector<double>{40100.5, 30200, 30400, 30100}));
  EXPECT_EQ(log.timer_max_ms.at("optimizer").size(), 4u);
}

TEST(TrainingLog, ReadsTorchtitanLinesWithTheirColours) {
  const TrainingLog log = parse_training_log(sample("torchtitan.log"), "torchtitan.log");
  EXPECT_EQ(log.format, LogFormat::kTorchtitan);
  ASSERT_EQ(log.iterations.size(), 4u);
  EXPECT_EQ(log.iterations[1].iteration, 2);
  EXPECT_DOUBLE_EQ(log.iterations[1].tokens_per_s_per_gpu, 2205);  // "tps: 2,205"
  EXPECT_DOUBLE_EQ(log.iterations[1].tflops_per_gpu, 168.70);
  EXPECT_DOUBLE_EQ(log.iterations[1].memory_bytes, 63.75 * 1024 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(log.iterations[0].loss, 10.8123);
}

TEST(TrainingLog, ReadsSmpScriptLinesWithoutItsValidationLines) {
  const TrainingLog log = parse_training_log(sample("smp.log"), "smp.log");
  EXPECT_EQ(log.format, LogFormat::kSmp);
  ASSERT_EQ(log.iterations.size(), 4u);
  EXPECT_EQ(log.iterations[3].iteration, 3);
  EXPECT_DOUBLE_EQ(log.iterations[2].samples_per_s, 1.28);
  EXPECT_DOUBLE_EQ(log.iterations[2].tflops_per_gpu, 105.56);
}

// The Trainer's summary at the end of train(): steps and samples per second of the whole run.
TEST(TrainingLog, ReadsTheHuggingFaceTrainerSummary) {
  const TrainingLog log = parse_training_log(sample("hf_trainer.log"), "hf_trainer.log");
  EXPECT_EQ(log.format, LogFormat::kHfTrainer);
  ASSERT_EQ(log.iterations.size(), 1u);
  EXPECT_EQ(log.iterations[0].line, 6);
  EXPECT_DOUBLE_EQ(log.iterations[0].step_ms, 1000.0 / 0.032);
  EXPECT_DOUBLE_EQ(log.iterations[0].samples_per_s, 65.536);
  EXPECT_DOUBLE_EQ(log.iterations[0].loss, 9.5012);
  std::string bad = sample("hf_trainer.log");
  bad.replace(bad.find("0.032"), 5, "'?'");
  EXPECT_NE(refusal(bad).find("run.log: line 6: is a Hugging Face Trainer summary"), std::string::npos) << refusal(bad);
}

TEST(TrainingLog, RefusesABadLineByItsNumber) {
  std::string text = sample("megatron.log");
  const size_t at = text.find("31020.0");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 7, "n/a");
  EXPECT_EQ(refusal(text),
            "run.log: line 9: is a Megatron-LM iteration line without a readable iteration number and elapsed time\n");
  std::string titan = sample("torchtitan.log");
  titan.replace(titan.find("2,205"), 5, "-");
  EXPECT_NE(refusal(titan).find("run.log: line 3: is a torchtitan step line"), std::string::npos);
}

TEST(TrainingLog, RefusesForeignMixedAndBinaryLogs) {
  EXPECT_NE(refusal("epoch 1 done\nall good\n").find("run.log: holds no iteration line"), std::string::npos);
  const std::string mixed = sample("megatron.log") + sample("smp.log");
  EXPECT_NE(refusal(mixed).find("run.log: line 22: is a SMP line in a Megatron-LM log"), std::string::npos)
      << refusal(mixed);
  EXPECT_NE(refusal(std::string("step: 1 tps: 5\n\0\n", 17)).find("NUL byte"), std::string::npos);
  try {
    read_training_log("/nonexistent/run.log");
    FAIL() << "a missing log must be refused";
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), "/nonexistent/run.log");
  }
}

}  // namespace
}  // namespace moeplan
