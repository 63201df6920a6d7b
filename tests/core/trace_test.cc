#include "moeplan/core/trace.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_support.h"

namespace moeplan {
namespace {

using test::TempDir;
constexpr auto op = test::trace_op;

// A measured step of two micro-batches on two ranks, with a gather and a memory curve.
Trace measured_step() {
  Trace t;
  t.source = "measured";
  t.ranks = 2;
  for (int64_t r = 0; r < 2; ++r) {
    const int64_t skew = r * 1000;
    t.events.push_back(op("forward", "compute", r, TraceStream::kCompute, 0 + skew, 100'000));
    t.events.push_back(op("dense.all_gather", "all_gather", r, TraceStream::kShardGather, 10'000 + skew, 5'000));
    t.events.back().group = 0;  // both ranks' shard group
    t.events.push_back(op("backward", "compute", r, TraceStream::kCompute, 100'000 + skew, 200'000));
    t.events.push_back(op("forward", "compute", r, TraceStream::kCompute, 300'000 + skew, 110'000));
    t.events.push_back(op("backward", "compute", r, TraceStream::kCompute, 410'000 + skew, 190'000));
    t.events.push_back(op("optimizer", "compute", r, TraceStream::kCompute, 600'000 + skew, 60'000));
    t.events.back().flops = 1e9;
    t.events.back().bytes = 4096;
    t.memory.push_back({r, 0, 1e6});
    t.memory.push_back({r, 100'000 + skew, 3.5e6});
    t.memory.push_back({r, 300'000 + skew, 1.25e6});
  }
  return t;
}

// The simulator's names for the same step: per block ops, the head split a third forward.
Trace simulated_step() {
  Trace t;
  t.source = "simulated";
  t.ranks = 1;
  int64_t at = 0;
  for (int mb = 0; mb < 2; ++mb) {
    const std::string p = "mb" + std::to_string(mb) + ".";
    t.events.push_back(op(p + "L0.attn_fwd", "compute", 0, TraceStream::kCompute, at, 40'000));
    t.events.push_back(op(p + "L0.experts_fwd", "compute", 0, TraceStream::kCompute, at + 40'000, 40'000));
    t.events.push_back(op(p + "head_fwd_bwd", "compute", 0, TraceStream::kCompute, at + 80'000, 60'000));
    t.events.push_back(op(p + "L0.experts_recompute", "compute", 0, TraceStream::kCompute, at + 140'000, 20'000));
    t.events.push_back(op(p + "L0.experts_bwd", "compute", 0, TraceStream::kCompute, at + 160'000, 60'000));
    t.events.push_back(op(p + "L0.attn_bwd", "compute", 0, TraceStream::kCompute, at + 220'000, 60'000));
    at += 280'000;
  }
  t.events.push_back(op("optimizer", "compute", 0, TraceStream::kCompute, at, 30'000));
  return t;
}

std::string written(const TempDir& dir, const std::string& name, const Trace& t) {
  return dir.write(name, to_json(t).dump());
}

// The problems read_trace_file reports for a file with this text.
std::vector<Diagnostic> problems(const std::string& text) {
  TempDir dir;
  const std::string path = dir.write("trace.json", text);
  try {
    read_trace_file(path);
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), path);
    return e.diagnostics();
  }
  ADD_FAILURE() << "no error for: " << text;
  return {};
}

bool reports(const std::vector<Diagnostic>& d, const std::string& path, const std::string& words) {
  for (const Diagnostic& x : d)
    if (x.path == path && x.message.find(words) != std::string::npos) return true;
  std::string all;
  for (const Diagnostic& x : d) all += "\n  " + x.to_string();
  ADD_FAILURE() << "expected " << path << ": ..." << words << "... among:" << all;
  return false;
}

TEST(TraceFile, StreamedReadEqualsTheDocumentReadWithMemory) {
  TempDir dir;
  const Trace t = measured_step();
  const std::string path = written(dir, "t.json", t);
  const Trace streamed = read_trace_file(path);
  EXPECT_EQ(streamed, t);
  EXPECT_EQ(trace_from_json(read_json_file(path), path), t);
  ASSERT_EQ(streamed.memory.size(), 6u);
  EXPECT_EQ(streamed.memory[4].time_ns, 101'000);
  EXPECT_DOUBLE_EQ(streamed.memory[4].bytes, 3.5e6);
}

// A trace says which plan it is of; both readers take it back, and two traces of different
// plans say how they differ.
TEST(TraceFile, ThePlanATraceIsOfIsReadBack) {
  TempDir dir;
  Trace t = measured_step();
  t.plan = "E2 S1 R1 RSE ckpt=none mbs=1 ga=2";
  t.world_size = 2;
  const std::string path = written(dir, "t.json", t);
  EXPECT_EQ(read_trace_file(path), t);
  EXPECT_EQ(trace_from_json(read_json_file(path), path), t);
  Trace simulated = simulated_step();
  EXPECT_EQ(plan_difference(simulated, t), "");  // the simulated one does not say
  simulated.plan = t.plan;
  simulated.world_size = 2;
  EXPECT_EQ(plan_difference(simulated, t), "");
  simulated.plan = "E4 S1 R1 T2 sp P2 V8 RSE ckpt=none mbs=1 ga=512";
  simulated.world_size = 16;
  EXPECT_EQ(plan_difference(simulated, t),
            "the simulated trace is of E4 S1 R1 T2 sp P2 V8 RSE ckpt=none mbs=1 ga=512 on 16 ranks, the measured one "
            "of E2 S1 R1 RSE ckpt=none mbs=1 ga=2 on 2 ranks");
  EXPECT_TRUE(reports(problems(R"({"traceEvents": [], "otherData": {"plan": 3}})"), "otherData.plan", "expected a string"));
}

TEST(TraceFile, ReadsWhatTheSimulatorWrites) {
  // A trace of the documentation, written by `moeplan simulate --trace`.
  const std::string path = std::string(MOEPLAN_TEST_DATA_DIR) + "/../../docs/traces/mixtral-8x7b-p4d-16.json";
  const Trace streamed = read_trace_file(path);
  EXPECT_EQ(streamed, trace_from_json(read_json_file(path), path));
  EXPECT_EQ(streamed.source, "simulated");
  EXPECT_GT(streamed.events.size(), 1000u);
}

TEST(TraceFile, ProgressIsReportedForLargeFiles) {
  Trace t;
  t.ranks = 1;
  for (int64_t i = 0; i < 70'000; ++i) t.events.push_back(op("x", "compute", 0, TraceStream::kCompute, i * 10, 5));
  TempDir dir;
  const std::string path = written(dir, "big.json", t);
  std::vector<int64_t> seen;
  const Trace back = read_trace_file(path, [&](const TraceReadProgress& p) {
    seen.push_back(p.events);
    EXPECT_GT(p.file_bytes, 70'000);
  });
  EXPECT_EQ(back.events.size(), 70'000u);
  ASSERT_GE(seen.size(), 2u);  // once at 65,536 events, once at the end
  EXPECT_LT(seen.front(), seen.back());
  EXPECT_EQ(seen.back(), 70'000);
}

TEST(TraceFile, MalformedFilesAreRefusedWithTheEventAndField) {
  const std::string head = R"({"traceEvents": [)";
  const std::string good = R"({"name": "a", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "tid": 0})";
  EXPECT_TRUE(reports(problems(head + good + R"(, {"name": "b", "ph": "X", "ts": "soon", "dur": 2, "pid": 0}]})"),
                      "traceEvents[1].ts", "expected a number"));
  EXPECT_TRUE(reports(problems(head + R"({"name": "b", "ph": "X", "ts": 1, "dur": 2}]})"), "traceEvents[0].pid",
                      "missing"));
  EXPECT_TRUE(reports(problems(head + R"({"name": "b", "ph": "X", "ts": 1, "dur": -2, "pid": 0}]})"),
                      "traceEvents[0].dur", "must be in"));
  EXPECT_TRUE(reports(problems(head + R"({"name": "b", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "tid": 9}]})"),
                      "traceEvents[0].tid", "must be in"));
  EXPECT_TRUE(reports(problems(head + R"({"name": "b", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "colour": 3}]})"),
                      "traceEvents[0].colour", "unknown field"));
  EXPECT_TRUE(reports(problems(head + R"({"name": "b", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "args": {"group": -1}}]})"),
                      "traceEvents[0].args.group", "must be in"));
  EXPECT_TRUE(reports(problems(head + R"({"name": "b", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "args": {"group": "e"}}]})"),
                      "traceEvents[0].args.group", "expected an integer"));
  EXPECT_TRUE(reports(problems(head + R"({"ts": 1}]})"), "traceEvents[0].ph", "missing"));
  EXPECT_TRUE(reports(problems(head + R"(7]})"), "traceEvents[0]", "expected an object"));
  EXPECT_TRUE(reports(problems(head + R"({"name": "memory", "ph": "C", "ts": 1, "pid": 0, "args": {"bytes": "lots"}}]})"),
                      "traceEvents[0].args.bytes", "expected a number"));
  EXPECT_TRUE(reports(problems(R"({"traceEvents": 5})"), "traceEvents", "expected an array"));
  EXPECT_TRUE(reports(problems(R"({"events": []})"), "events", "unknown field"));
  EXPECT_TRUE(reports(problems(R"({"displayTimeUnit": "ns"})"), "traceEvents", "missing"));
  EXPECT_TRUE(reports(problems(R"([1, 2])"), "", "expected an object"));
  // Cut off in the middle, as a file still being written would be.
  EXPECT_TRUE(reports(problems(head + good + R"(, {"name": "b", "ph)"), "", "not valid JSON at byte"));
  EXPECT_TRUE(reports(problems(""), "", "not valid JSON"));
}

TEST(TraceFile, MissingFileIsAnInputError) {
  EXPECT_THROW(read_trace_file("/nonexistent/trace.json"), InputError);
}

TEST(TraceFile, MetadataAndOtherCountersAreSkipped) {
  TempDir dir;
  const std::string path = dir.write("t.json", std::string(R"({"traceEvents": [
    {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0", "extra": [1, {"a": 2}]}},
    {"name": "load", "ph": "C", "ts": 0, "pid": 0, "args": {"cpu": 3}},
    {"name": "a", "ph": "X", "ts": 1.5, "dur": 2, "pid": 3, "cat": "copy", "tid": 4}]})"));
  const Trace t = read_trace_file(path);
  ASSERT_EQ(t.events.size(), 1u);
  EXPECT_EQ(t.events[0].start_ns, 1500);
  EXPECT_EQ(t.events[0].duration_ns, 2000);
  EXPECT_EQ(t.events[0].stream, TraceStream::kCopy);
  EXPECT_EQ(t.ranks, 4);
  EXPECT_TRUE(t.memory.empty());
}

TEST(TracePhases, MeasuredPhasesInMicroBatchOrder) {
  const std::vector<TracePhase> p = step_phases(measured_step(), 1);
  ASSERT_EQ(p.size(), 5u);
  EXPECT_EQ(p[0].name, "mb0 forward");
  EXPECT_EQ(p[0].start_ns, 1000);
  EXPECT_EQ(p[0].end_ns, 101'000);
  EXPECT_EQ(p[1].name, "mb0 backward");
  EXPECT_EQ(p[2].name, "mb1 forward");
  EXPECT_EQ(p[3].name, "mb1 backward");
  EXPECT_EQ(p[4].name, "optimizer");
  EXPECT_EQ(p[4].end_ns, 661'000);
  EXPECT_TRUE(step_phases(measured_step(), 7).empty());
}

TEST(TracePhases, SimulatedPhasesSplitTheHeadAtAThird) {
  const std::vector<TracePhase> p = step_phases(simulated_step(), 0);
  ASSERT_EQ(p.size(), 5u);
  EXPECT_EQ(p[0].name, "mb0 forward");
  EXPECT_EQ(p[0].end_ns, 100'000);  // 80,000 + 60,000 / 3
  EXPECT_EQ(p[1].name, "mb0 backward");
  EXPECT_EQ(p[1].start_ns, 100'000);
  EXPECT_EQ(p[1].end_ns, 280'000);
  EXPECT_EQ(p[2].name, "mb1 forward");
  EXPECT_EQ(p[2].start_ns, 280'000);
  EXPECT_EQ(p[4].name, "optimizer");
}

TEST(TracePhases, DifferencesLargestFirstOverTheSharedRanks) {
  const std::vector<PhaseDifference> d = compare_phases(simulated_step(), measured_step());
  ASSERT_EQ(d.size(), 5u);
  // Measured against simulated: optimizer 60 against 30 us, mb1 forward 110 against 100,
  // mb0 backward 200 against 180, mb1 backward 190 against 180, mb0 forward 100 against 100.
  EXPECT_EQ(d[0].phase, "optimizer");
  EXPECT_NEAR(d[0].first_s, 30e-6, 1e-12);
  EXPECT_NEAR(d[0].second_s, 60e-6, 1e-12);
  EXPECT_EQ(d[1].phase, "mb0 backward");
  EXPECT_EQ(d[4].phase, "mb0 forward");
  EXPECT_NEAR(d[4].second_s - d[4].first_s, 0.0, 1e-12);
  for (size_t i = 1; i < d.size(); ++i)
    EXPECT_GE(std::abs(d[i - 1].second_s - d[i - 1].first_s), std::abs(d[i].second_s - d[i].first_s));
}

TEST(TracePhases, AlignmentMovesEachPhaseToTheReferenceStart) {
  const Trace sim = simulated_step(), measured = measured_step();
  const Trace aligned = align_phases(measured, sim);
  const std::vector<TracePhase> a = step_phases(aligned, 0), s = step_phases(sim, 0);
  ASSERT_EQ(a.size(), s.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, s[i].name);
    EXPECT_EQ(a[i].start_ns, s[i].start_ns) << a[i].name;
  }
  // The gather inside mb0's forward moves with it (by 0), the memory sample at mb1's forward
  // with mb1 forward (300,000 -> 280,000).
  EXPECT_EQ(aligned.events[1].start_ns, 10'000);
  EXPECT_EQ(aligned.memory[2].time_ns, 280'000);
  // Rank 1 has no phases in the reference: it stays where it was.
  EXPECT_EQ(step_phases(aligned, 1)[2].start_ns, 301'000);
}

// Found by fuzzing (fuzz/trace_fuzzer.cc): a 75-byte trace saying it has 2^24 ranks made the
// phase functions hold a table of every rank, twice per comparison (gigabytes, and past the
// fuzzer's 10 s limit). They hold the ranks that have compute events.
TEST(TracePhases, DeclaredRanksWithoutEventsCostNothing) {
  TempDir dir;
  const Trace empty = read_trace_file(
      dir.write("t.json", R"({"traceEvents": [], "otherData": {"moeplan_trace_version": 1, "ranks": 16777216}})"));
  ASSERT_EQ(empty.ranks, 16777216);
  EXPECT_TRUE(step_phases(empty, 0).empty());
  EXPECT_TRUE(compare_phases(empty, empty).empty());
  EXPECT_TRUE(align_phases(empty, empty).events.empty());
  // One step on the last rank of such a trace: its phases, compared with the measured step's.
  Trace last = empty;
  last.events.push_back(op("forward", "compute", 16777215, TraceStream::kCompute, 0, 50'000));
  ASSERT_EQ(step_phases(last, 16777215).size(), 1u);
  EXPECT_EQ(step_phases(last, 16777215)[0].name, "mb0 forward");
  // No rank in common: every rank's longest mb0 forward, 50 us against the measured 100 us.
  const std::vector<PhaseDifference> d = compare_phases(last, measured_step());
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].phase, "mb0 forward");
  EXPECT_NEAR(d[0].first_s, 50e-6, 1e-12);
  EXPECT_NEAR(d[0].second_s, 100e-6, 1e-12);
}

}  // namespace
}  // namespace moeplan
