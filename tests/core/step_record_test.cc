#include "moeplan/core/step_record.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "test_support.h"

namespace moeplan {
namespace {

// Two layers of two experts; one expert group of two micro-batches.
StepRecord two_micro_batches() {
  StepRecord r;
  r.step = 3;
  r.loss = 5.5;
  r.aux_loss = 1.01;
  r.z_loss = 0.2;
  r.total_loss = 5.52;
  r.learning_rate = 1e-3;
  r.grad_norm = 0.75;
  r.tokens = 512;
  r.seconds = 0.25;
  r.exchange_slots = {{{{300, 212}, {256, 256}}, {{100, 412}, {500, 12}}}};
  r.tokens_per_expert = {{400, 624}, {756, 268}};
  r.exchange_seconds = {0.125, 0.0625};
  r.dropped_slots = {12, 0};
  return r;
}

std::string first_problem(const Json& j) {
  try {
    step_record_from_json(j, "metrics.jsonl:1");
  } catch (const InputError& e) {
    return e.diagnostics().front().path + ": " + e.diagnostics().front().message;
  }
  return "";
}

TEST(StepRecord, ALineReadsBackAsWritten) {
  const StepRecord r = two_micro_batches();
  EXPECT_EQ(step_record_from_json(parse_json_text(to_json_line(r), "line"), "line"), r);
  StepRecord skipped = r;
  skipped.skipped = true;
  skipped.nonfinite = "layer 1";
  skipped.loss = std::nan("");
  const StepRecord back = step_record_from_json(parse_json_text(to_json_line(skipped), "line"), "line");
  EXPECT_TRUE(std::isnan(back.loss));
  EXPECT_TRUE(back.skipped);
  EXPECT_EQ(back.nonfinite, "layer 1");
  EXPECT_EQ(back.exchange_slots, r.exchange_slots);
}

TEST(StepRecord, BadLinesNameTheField) {
  const Json good = parse_json_text(to_json_line(two_micro_batches()), "line");
  Json j = good;
  j["exchange_slots"][0][1][0] = {1, 2, 3};
  EXPECT_EQ(first_problem(j), "exchange_slots[0][1]: is not a [layer][expert] table of tokens_per_expert's shape");
  j = good;
  j["exchange_slots"][0][1][1][0] = -1;
  EXPECT_EQ(first_problem(j), "exchange_slots[0][1][1]: expected non-negative integer token counts, got number -1");
  j = good;
  j["loss"] = "high";
  EXPECT_EQ(first_problem(j), "loss: expected a number or null, got string \"high\"");
  j = good;
  j["exchange_s"][1] = -0.5;
  EXPECT_EQ(first_problem(j), "exchange_s[1]: expected seconds (a finite number >= 0), got number -0.5");
  j = good;
  j["dropped_slots"] = {1, 2, 3};
  EXPECT_EQ(first_problem(j), "dropped_slots: counts 3 layers, tokens_per_expert 2");
  j = good;
  j["dropped_slots"][0] = -4;
  EXPECT_EQ(first_problem(j), "dropped_slots: expected non-negative integer token counts, got number -4");
  j = good;
  j["step_time"] = 1;
  EXPECT_EQ(first_problem(j), "step_time: unknown field");
  j = good;
  j.erase("exchange_slots");
  j.erase("dropped_slots");
  EXPECT_EQ(first_problem(j), "");  // a line written before per-micro-batch counts, or dropless
}

TEST(StepRecord, TheHypervisorsStealIsKeptWhereTheMachineSaysIt) {
  StepRecord r = two_micro_batches();
  EXPECT_FALSE(undisturbed(r));  // not measured: not known to be left alone
  EXPECT_EQ(to_json_line(r).find("steal"), std::string::npos);
  r.steal = 0.004;
  EXPECT_TRUE(undisturbed(r));
  EXPECT_EQ(step_record_from_json(parse_json_text(to_json_line(r), "line"), "line"), r);
  r.steal = 0.25;
  EXPECT_FALSE(undisturbed(r));
  EXPECT_EQ(step_record_from_json(parse_json_text(to_json_line(r), "line"), "line").steal, 0.25);
  Json j = parse_json_text(to_json_line(r), "line");
  j["steal"] = 1.5;
  EXPECT_EQ(first_problem(j).substr(0, 7), "steal: ") << first_problem(j);
  j["steal"] = "some";
  EXPECT_EQ(first_problem(j).substr(0, 7), "steal: ") << first_problem(j);
}

TEST(StepRecord, AFileIsReadLineByLine) {
  test::TempDir dir;
  const std::string path =
      dir.write("metrics.jsonl", to_json_line(two_micro_batches()) + "\n\n" + to_json_line(two_micro_batches()) + "\n{\n");
  try {
    read_step_records(path);
    FAIL() << "a broken line was taken";
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin().substr(0, path.size()), path);
    EXPECT_NE(e.lines().front().find(path + ":4"), std::string::npos) << e.lines().front();
  }
  EXPECT_EQ(read_step_records(dir.write("two.jsonl", to_json_line(two_micro_batches()) + "\n")).size(), 1u);
}

}  // namespace
}  // namespace moeplan
