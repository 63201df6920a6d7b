// Reading other frameworks' training logs: samples in each framework's own line format
// (tests/data/logs), bad lines refused by number, foreign files refused by name.
#include "moeplan/frameworks/training_log.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

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
  EXPECT_EQ(log.format->name, "Megatron-LM");
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
  EXPECT_EQ(log.format->name, "torchtitan");
  ASSERT_EQ(log.iterations.size(), 4u);
  EXPECT_EQ(log.iterations[1].iteration, 2);
  EXPECT_DOUBLE_EQ(log.iterations[1].tokens_per_s_per_gpu, 2205);  // "tps: 2,205"
  EXPECT_DOUBLE_EQ(log.iterations[1].tflops_per_gpu, 168.70);
  EXPECT_DOUBLE_EQ(log.iterations[1].memory_bytes, 63.75 * 1024 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(log.iterations[0].loss, 10.8123);
}

TEST(TrainingLog, ReadsSmpScriptLinesWithoutItsValidationLines) {
  const TrainingLog log = parse_training_log(sample("smp.log"), "smp.log");
  EXPECT_EQ(log.format->name, "SMP");
  ASSERT_EQ(log.iterations.size(), 4u);
  EXPECT_EQ(log.iterations[3].iteration, 3);
  EXPECT_DOUBLE_EQ(log.iterations[2].samples_per_s, 1.28);
  EXPECT_DOUBLE_EQ(log.iterations[2].tflops_per_gpu, 105.56);
}

// The Trainer's summary at the end of train(): steps and samples per second of the whole run.
TEST(TrainingLog, ReadsTheHuggingFaceTrainerSummary) {
  const TrainingLog log = parse_training_log(sample("hf_trainer.log"), "hf_trainer.log");
  EXPECT_EQ(log.format->name, "Hugging Face Trainer");
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

// Mutated samples (bytes changed, cut short, numbers replaced by extreme ones, two logs run
// together) are read or refused with an InputError, never anything else; what is read holds
// only finite, positive rates. The seed is fixed, so a failure reproduces exactly.
TEST(TrainingLog, MutatedLogsAreReadOrRefused) {
  const std::vector<std::string> samples = {sample("megatron.log"), sample("torchtitan.log"), sample("smp.log"),
                                            sample("hf_trainer.log")};
  const std::vector<std::string> numbers = {"1e308", "-5", "0", "99999999999999999999", "nan", "inf", "1e-320",
                                            "1,2,3", "0x10", "."};
  std::mt19937_64 random(0x6c6f6773);  // "logs"
  auto below = [&](size_t n) { return static_cast<size_t>(random() % std::max<size_t>(1, n)); };
  int64_t read = 0, refused = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string text = samples[below(samples.size())];
    switch (below(4)) {
      case 0:
        for (size_t k = 1 + below(16); k > 0; --k) text[below(text.size())] = static_cast<char>(random() & 0xff);
        break;
      case 1: text.resize(below(text.size() + 1)); break;
      case 2:
        for (size_t k = 1 + below(6); k > 0; --k) {
          const size_t at = text.find_first_of("0123456789", below(text.size()));
          if (at == std::string::npos) break;
          const size_t end = text.find_first_not_of("0123456789.", at);
          text.replace(at, (end == std::string::npos ? text.size() : end) - at, numbers[below(numbers.size())]);
        }
        break;
      default: text += samples[below(samples.size())]; break;
    }
    try {
      const TrainingLog log = parse_training_log(text, "fuzz.log");
      ++read;
      for (const LoggedIteration& it : log.iterations) {
        ASSERT_TRUE(std::isfinite(it.step_ms) && it.step_ms >= 0) << text;
        ASSERT_TRUE(std::isfinite(it.tokens_per_s_per_gpu) && it.tokens_per_s_per_gpu >= 0) << text;
        ASSERT_TRUE(std::isfinite(it.samples_per_s) && it.samples_per_s >= 0) << text;
        ASSERT_GE(it.iteration, 0) << text;
        ASSERT_GE(it.global_batch, 0) << text;
      }
    } catch (const InputError&) {
      ++refused;
    }
  }
  std::printf("training-log fuzz: %lld read, %lld refused\n", static_cast<long long>(read),
              static_cast<long long>(refused));
  EXPECT_GT(read, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace moeplan
