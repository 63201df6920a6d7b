#include "moeplan/core/json_reader.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/model_spec.h"
#include "problems.h"
#include "test_support.h"

namespace moeplan {
namespace {

using test::profile_path;
using test::read_text;
using test::data_path;
using test::TempDir;
using test::problems_of;

std::string describe(const std::vector<Diagnostic>& diagnostics) {
  std::string text;
  for (const Diagnostic& d : diagnostics) text += "\n  " + d.to_string();
  return text;
}


// ---------------------------------------------------------------------------------------------
// parse_json_text and read_json_file

TEST(ParseJsonText, ParsesValidText) {
  const Json json = parse_json_text(R"({"a": [1, 2.5, "x", null, true], "b": {}})", "t.json");
  EXPECT_EQ(json["a"][1], 2.5);
  EXPECT_TRUE(json["b"].is_object());
}

TEST(ParseJsonText, TruncatedTextNamesLineAndColumn) {
  const auto problems = problems_of([] { parse_json_text("{\"a\": [1, 2", "t.json"); }, "t.json");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "");
  EXPECT_EQ(problems[0].message.rfind("not valid JSON (parse error at line 1, column 12: ", 0), 0u)
      << problems[0].message;
  // The nlohmann tag ("[json.exception.parse_error.101]") is cut off.
  EXPECT_EQ(problems[0].message.find("json.exception"), std::string::npos) << problems[0].message;
}

TEST(ParseJsonText, SyntaxErrorsAreInputErrors) {
  for (const char* text : {"", "{", "}", "{\"a\" 1}", "{\"a\": 1,}", "[1 2]", "tru", "\"abc", "{\"a\": 01}",
                           "{\"a\": -}", "{\"a\": 1e}", "{\"a\": \"\\x\"}", "\xff", "{} {}", "NaN", "Infinity"}) {
    const auto problems = problems_of([&] { parse_json_text(text, "t.json"); }, "t.json");
    ASSERT_EQ(problems.size(), 1u) << text;
    EXPECT_EQ(problems[0].message.rfind("not valid JSON (", 0), 0u) << text << ": " << problems[0].message;
  }
}

// A number beyond a double (1e400) makes nlohmann throw out_of_range, not parse_error; it is
// still malformed input and must come back as an InputError naming the file.
TEST(ParseJsonText, NumberOutsideDoubleRangeIsAnInputError) {
  for (const char* text : {"1e400", "[-1e400]", "{\"world_size\": 1e400}"}) {
    const auto problems = problems_of([&] { parse_json_text(text, "t.json"); }, "t.json");
    if (!problems.empty()) {
      EXPECT_EQ(problems[0].path, "") << text;
    }
  }
}

TEST(ParseJsonText, HugeIntegersBecomeNumbersNotErrors) {
  EXPECT_TRUE(parse_json_text("18446744073709551615", "t").is_number_unsigned());
  EXPECT_TRUE(parse_json_text("18446744073709551616", "t").is_number_float());
  EXPECT_TRUE(parse_json_text("-9223372036854775809", "t").is_number_float());
  EXPECT_EQ(parse_json_text("1e-400", "t").get<double>(), 0.0);  // underflow is not an error
}

TEST(ReadJsonFile, MissingFileNamesThePath) {
  TempDir dir;
  const std::string path = dir.file("nowhere.json");
  const auto problems = problems_of([&] { read_json_file(path); }, path);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "");
  EXPECT_EQ(problems[0].message, "cannot open file");
}

TEST(ReadJsonFile, TruncatedFileNamesThePath) {
  TempDir dir;
  const std::string text = read_text(profile_path("hardware/p4d.24xlarge.json"));
  const std::string path = dir.write("p4d.json", text.substr(0, text.size() / 2));
  const auto problems = problems_of([&] { read_json_file(path); }, path);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].message.rfind("not valid JSON (parse error at line ", 0), 0u) << problems[0].message;
}

TEST(ReadJsonFile, DirectoryIsAnInputErrorSayingSo) {
  TempDir dir;
  const std::string path = dir.file("");
  const auto problems = problems_of([&] { read_json_file(path); }, path);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].message, "is a folder, not a JSON file");
}

// ---------------------------------------------------------------------------------------------
// ObjectReader

struct Read {
  Diagnostics diagnostics;
  Json json;
  explicit Read(const char* text) : json(Json::parse(text)) {}
  ObjectReader reader(SourceMap* sources = nullptr) { return ObjectReader(json, "obj", diagnostics, sources); }
  std::string only_problem() const {
    EXPECT_EQ(diagnostics.items().size(), 1u) << describe(diagnostics.items());
    return diagnostics.items().empty() ? "" : diagnostics.items()[0].to_string();
  }
};

TEST(ObjectReader, IntegersAcceptIntegralFloats) {
  Read r(R"({"a": 4.0e10, "b": 7, "c": -3})");
  ObjectReader o = r.reader();
  EXPECT_EQ(o.integer("a", 0, int64_t{1} << 40), 40'000'000'000);
  EXPECT_EQ(o.integer("b", 0, 10), 7);
  EXPECT_EQ(o.integer("c", -5, 10), -3);
  o.finish();
  EXPECT_TRUE(r.diagnostics.empty()) << describe(r.diagnostics.items());
}

TEST(ObjectReader, IntegerProblems) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"({"n": 2.5})", "obj.n: expected an integer, got number 2.5"},
      {R"({"n": "8"})", "obj.n: expected an integer, got string \"8\""},
      {R"({"n": true})", "obj.n: expected an integer, got true"},
      {R"({"n": null})", "obj.n: expected an integer, got null"},
      {R"({"n": [8]})", "obj.n: expected an integer, got an array"},
      {R"({"n": 11})", "obj.n: must be in [1, 10], got 11"},
      {R"({"n": 0})", "obj.n: must be in [1, 10], got 0"},
      {R"({"n": -1})", "obj.n: must be in [1, 10], got -1"},
      {R"({"n": 1e300})", "obj.n: must be in [1, 10], got 1e+300"},
      {R"({"n": -1e300})", "obj.n: must be in [1, 10], got -1e+300"},
      {R"({"n": 18446744073709551615})", "obj.n: must be in [1, 10], got 18446744073709551615"},
      {R"({"n": -9223372036854775808})", "obj.n: must be in [1, 10], got -9223372036854775808"},
      {R"({})", "obj.n: missing required field"},
  };
  for (const auto& [text, expected] : cases) {
    Read r(text);
    ObjectReader o = r.reader();
    EXPECT_EQ(o.integer("n", 1, 10), 1) << text;  // the neutral value, so reading goes on
    EXPECT_EQ(r.only_problem(), expected) << text;
  }
}

TEST(ObjectReader, NumberProblems) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"({"x": "1.5"})", "obj.x: expected a number, got string \"1.5\""},
      {R"({"x": {}})", "obj.x: expected a number, got an object"},
      {R"({"x": 1e300})", "obj.x: must be in [0, 1], got 1e+300"},
      {R"({"x": -0.25})", "obj.x: must be in [0, 1], got -0.25"},
      {R"({"x": 18446744073709551615})", "obj.x: must be in [0, 1], got 18446744073709551615"},
  };
  for (const auto& [text, expected] : cases) {
    Read r(text);
    ObjectReader o = r.reader();
    o.number("x", 0.0, 1.0);
    EXPECT_EQ(r.only_problem(), expected) << text;
  }
}

TEST(ObjectReader, OptionalFieldsTakeTheirFallback) {
  Read r(R"({})");
  ObjectReader o = r.reader();
  EXPECT_EQ(o.integer("i", 1, 10, 7), 7);
  EXPECT_EQ(o.number("x", 0, 1, 0.5), 0.5);
  EXPECT_TRUE(o.boolean("b", true));
  EXPECT_EQ(o.string("s", "dflt"), "dflt");
  EXPECT_FALSE(o.nullable_integer("w", 1, 10).has_value());
  EXPECT_FALSE(o.object("nested", true).has_value());
  EXPECT_TRUE(r.diagnostics.empty()) << describe(r.diagnostics.items());
}

TEST(ObjectReader, LongStringsAreShortenedInMessages) {
  Read r(R"({"n": "0123456789012345678901234567890123456789abcdef"})");
  ObjectReader o = r.reader();
  o.integer("n", 0, 1);
  EXPECT_EQ(r.only_problem(),
            "obj.n: expected an integer, got string \"0123456789012345678901234567890123456789...\"");
}

TEST(ObjectReader, UnknownFieldsAreReportedAtFinish) {
  Read r(R"({"known": 1, "unknwn": 2, "nested": {"deep": 1, "extra": 3}})");
  ObjectReader o = r.reader();
  o.integer("known", 0, 10);
  std::optional<ObjectReader> nested = o.object("nested");
  ASSERT_TRUE(nested.has_value());
  nested->integer("deep", 0, 10);
  nested->finish();
  o.finish();
  ASSERT_EQ(r.diagnostics.items().size(), 2u) << describe(r.diagnostics.items());
  EXPECT_EQ(r.diagnostics.items()[0].to_string(), "obj.nested.extra: unknown field");
  EXPECT_EQ(r.diagnostics.items()[1].to_string(), "obj.unknwn: unknown field");
}

TEST(ObjectReader, SourcedValuesAreUnwrappedAndRemembered) {
  Read r(R"({"bw": {"value": 5e10, "source": "datasheet"}, "plain": 3,
             "bad": {"value": 1}, "extra": {"value": 1, "source": "s", "note": "n"},
             "typed": {"value": 1, "source": 7}})");
  SourceMap sources;
  ObjectReader o = r.reader(&sources);
  EXPECT_EQ(o.number("bw", 0, 1e12), 5e10);
  EXPECT_EQ(o.integer("plain", 0, 10), 3);
  o.integer("bad", 0, 10);
  o.integer("extra", 0, 10);
  o.integer("typed", 0, 10);
  o.finish();
  EXPECT_EQ(sources, (SourceMap{{"obj.bw", "datasheet"}}));
  const std::vector<Diagnostic>& items = r.diagnostics.items();
  ASSERT_EQ(items.size(), 3u) << describe(items);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(items[i].message, "expected a value or {\"value\": ..., \"source\": \"...\"}") << i;
  EXPECT_EQ(items[0].path, "obj.bad");
  EXPECT_EQ(items[1].path, "obj.extra");
  EXPECT_EQ(items[2].path, "obj.typed");
}

TEST(ObjectReader, ChoiceListsTheAllowedNames) {
  static constexpr std::array<std::pair<std::string_view, int>, 2> kNames{{{"none", 0}, {"full", 1}}};
  Read r(R"({"c": "Full"})");
  ObjectReader o = r.reader();
  EXPECT_EQ(o.choice<int>("c", kNames), 0);
  EXPECT_EQ(r.only_problem(), "obj.c: expected one of \"none\", \"full\", got string \"Full\"");
}

TEST(ObjectReader, NotAnObject) {
  Diagnostics d;
  const Json json = Json::array();
  ObjectReader o(json, "cluster.gpu", d);
  EXPECT_FALSE(o.ok());
  o.integer("memory_bytes", 0, 10);  // reports nothing more: the object itself is wrong
  o.finish();
  ASSERT_EQ(d.items().size(), 1u);
  EXPECT_EQ(d.items()[0].to_string(), "cluster.gpu: expected an object, got an array");
}

TEST(DescribeJson, EveryKind) {
  EXPECT_EQ(describe_json(Json(nullptr)), "null");
  EXPECT_EQ(describe_json(Json(false)), "false");
  EXPECT_EQ(describe_json(Json("two")), "string \"two\"");
  EXPECT_EQ(describe_json(Json(-3)), "number -3");
  EXPECT_EQ(describe_json(Json(0.5)), "number 0.5");
  EXPECT_EQ(describe_json(Json::object()), "an object");
  EXPECT_EQ(describe_json(Json::array()), "an array");
  // Invalid UTF-8 in a string is replaced (and escaped), not thrown on.
  EXPECT_EQ(describe_json(Json(std::string("a\xff"))), "string \"a\\ufffd\"");
}

TEST(InputError, FirstLineCountsTheRest) {
  const InputError one("f.json", {{"a.b", "bad"}});
  EXPECT_STREQ(one.what(), "f.json: a.b: bad");
  const InputError three("f.json", {{"a", "x"}, {"", "y"}, {"c", "z"}});
  EXPECT_STREQ(three.what(), "f.json: a: x (and 2 more)");
  EXPECT_EQ(three.lines(), (std::vector<std::string>{"f.json: a: x", "f.json: y", "f.json: c: z"}));
}

// ---------------------------------------------------------------------------------------------
// Hardware profiles, read from files

Json p4d_json() { return Json::parse(read_text(profile_path("hardware/p4d.24xlarge.json"))); }

TEST(HardwareProfile, ShippedProfilesReadAndRoundTrip) {
  for (const char* name : {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge"}) {
    const ClusterSpec c = read_cluster_file(profile_path(std::string("hardware/") + name + ".json"));
    EXPECT_EQ(c.name, name);
    EXPECT_EQ(c.gpus_per_node, 8);
    EXPECT_FALSE(c.sources.empty());
    EXPECT_EQ(cluster_from_json(Json::parse(to_json(c).dump()), "again"), c) << name;
    EXPECT_EQ(c.kernels, Kernels::kFused) << name;
  }
  // The CPU profile describes moeplan's own executor, which runs eager kernels.
  const ClusterSpec cpu = read_cluster_file(profile_path("hardware/local-cpu.json"));
  EXPECT_EQ(cpu.kernels, Kernels::kEager);
  EXPECT_EQ(cluster_from_json(Json::parse(to_json(cpu).dump()), "again"), cpu);
}

struct ProfileEditPair {
  const char* pointer;
  Json value;
  const char* path;
  const char* message;
};

// A calibrated CPU profile: measured op times and per-collective fits read back as written.
Json calibrated_json() {
  Json json = Json::parse(read_text(profile_path("hardware/local-cpu.json")));
  json["intra_node"]["collectives"] = {
      {"source", "measured"},
      {"all_gather", {{"latency_s", 3e-4}, {"bandwidth_bytes_per_s", 7e8}, {"points", {{201728, 5e-4}, {3145728, 0.015}}}}},
      {"all_to_all", {{"latency_s", 2e-4}, {"bandwidth_bytes_per_s", 1e9}}}};
  json["host"]["processors"] = {{"value", 2}, {"source", "measured"}};
  json["framework"]["comm_overlaps_compute"] = false;
  json["framework"]["overlap_gradient_sync"] = false;
  json["framework"]["collective_after_compute"] = {
      {"source", "measured in lockstep"}, {"all_gather", {{0.0001, 1e-4}, {0.001, 1e-3}}}, {"all_to_all", {{0.06, 0.002}}}};
  json["framework"]["op_times"] = {
      {"source", "measured"},
      {"shapes",
       {{"hidden_size", 128}, {"intermediate_size", 256}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
        {"head_dim", 32}, {"num_experts", 8}, {"experts_per_token", 2}, {"vocab_size", 4096}, {"seq_len", 256},
        {"precision", "fp32"}, {"num_layers", 4}, {"qk_norm", true}}},
      {"attention_forward", {{256, 0.0015}, {512, 0.0035}}},
      {"attention_backward", {{256, 0.004}, {512, 0.006}}},
      {"router_forward", {{256, 0.0003}}},
      {"router_backward", {{256, 0.0003}}},
      {"expert_forward", {{16, 6e-5}, {4096, 0.0115}}},
      {"expert_backward", {{16, 1.5e-4}, {4096, 0.024}}},
      {"head", {{256, 0.04}, {512, 0.07}}},
      {"optimizer", {{549520, 0.0014}, {4396160, 0.069}}},
      {"micro_batch_forward", {{256, 0.027}, {512, 0.054}}},
      {"micro_batch_backward", {{256, 0.072}, {512, 0.108}}},
      {"recomputed_micro_batch_forward", {{256, 0.026}, {512, 0.052}}},
      {"recomputed_micro_batch_backward", {{256, 0.095}, {512, 0.15}}},
      {"tensor_splits",
       {{{"tensor_parallel_degree", 2},
         {"attention_forward", {{256, 0.0008}, {512, 0.0018}}},
         {"attention_backward", {{256, 0.002}, {512, 0.003}}},
         {"expert_forward", {{16, 4e-5}, {4096, 0.006}}},
         {"expert_backward", {{16, 9e-5}, {4096, 0.012}}},
         {"head", {{256, 0.021}, {512, 0.036}}},
         {"micro_batch_forward", {{256, 0.02}, {512, 0.04}}},
         {"micro_batch_backward", {{256, 0.05}, {512, 0.08}}},
         {"collectives_forward", {{256, 0.01}, {512, 0.02}}},
         {"collectives_backward", {{256, 0.012}, {512, 0.022}}}}}},
      {"expert_splits",
       {{{"expert_parallel_degree", 2},
         {"micro_batch_forward", {{256, 0.03}, {512, 0.06}}},
         {"micro_batch_backward", {{256, 0.08}, {512, 0.12}}},
         {"exchange_forward", {{256, 0.004}, {512, 0.006}}},
         {"exchange_backward", {{256, 0.005}, {512, 0.007}}}}}},
      {"shard_splits",
       {{{"hybrid_shard_degree", 2},
         {"micro_batch_forward", {{256, 0.035}, {512, 0.065}}},
         {"micro_batch_backward", {{256, 0.09}, {512, 0.13}}}}}}};
  return json;
}

TEST(HardwareProfile, CalibratedFieldsRoundTrip) {
  const ClusterSpec c = cluster_from_json(calibrated_json(), "calibrated.json");
  EXPECT_FALSE(c.comm_overlaps_compute);
  EXPECT_FALSE(c.overlap_gradient_sync);
  EXPECT_DOUBLE_EQ(c.all_gather_fit.bandwidth_bytes_per_s, 7e8);
  EXPECT_DOUBLE_EQ(c.all_gather_fit.measured_at(3145728), 0.015);
  EXPECT_DOUBLE_EQ(c.all_gather_fit.measured_at(3145728 * 1.005), 0.015);  // within 1%
  EXPECT_LT(c.all_gather_fit.measured_at(4194304), 0);                     // not measured there
  EXPECT_FALSE(c.reduce_scatter_fit.given());
  EXPECT_EQ(c.op_times.seq_len, 256);
  EXPECT_EQ(c.op_times.expert_backward.size(), 2u);
  EXPECT_EQ(c.op_times.micro_batch_backward.size(), 2u);
  EXPECT_EQ(c.op_times.recomputed_micro_batch_backward, (CurvePoints{{256, 0.095}, {512, 0.15}}));
  EXPECT_EQ(c.op_times.num_layers, 4);
  EXPECT_TRUE(c.op_times.blocks.qk_norm);
  ASSERT_EQ(c.op_times.tensor_splits.size(), 1u);
  ASSERT_NE(c.op_times.split(2), nullptr);
  EXPECT_EQ(c.op_times.split(2)->head, (CurvePoints{{256, 0.021}, {512, 0.036}}));
  EXPECT_EQ(c.op_times.split(2)->collectives_backward, (CurvePoints{{256, 0.012}, {512, 0.022}}));
  EXPECT_EQ(c.op_times.split(4), nullptr);
  ASSERT_NE(c.op_times.expert_split(2), nullptr);
  EXPECT_EQ(c.op_times.expert_split(2)->exchange_backward, (CurvePoints{{256, 0.005}, {512, 0.007}}));
  EXPECT_EQ(c.op_times.expert_split(4), nullptr);
  ASSERT_NE(c.op_times.shard_split(2), nullptr);
  EXPECT_EQ(c.op_times.shard_split(2)->micro_batch_backward, (CurvePoints{{256, 0.09}, {512, 0.13}}));
  EXPECT_EQ(c.op_times.shard_split(4), nullptr);
  EXPECT_EQ(c.sources.at("framework.op_times"), "measured");
  EXPECT_EQ(c.sources.at("intra_node.collectives"), "measured");
  EXPECT_EQ(c.after_compute.all_gather, (CurvePoints{{0.0001, 1e-4}, {0.001, 1e-3}}));
  EXPECT_EQ(c.after_compute.all_to_all, (CurvePoints{{0.06, 0.002}}));
  EXPECT_TRUE(c.after_compute.all_reduce.empty());
  EXPECT_EQ(c.sources.at("framework.collective_after_compute"), "measured in lockstep");
  EXPECT_EQ(c.host_processors, 2);
  EXPECT_EQ(cluster_from_json(Json::parse(to_json(c).dump()), "again"), c);
  // The shipped CPU profile overlaps nothing it does not say.
  EXPECT_TRUE(read_cluster_file(profile_path("hardware/local-cpu.json")).comm_overlaps_compute);
  EXPECT_TRUE(read_cluster_file(profile_path("hardware/local-cpu.json")).overlap_gradient_sync);
}

TEST(HardwareProfile, BadCalibratedFieldsAreNamed) {
  const std::vector<ProfileEditPair> edits = {
      {"/framework/op_times/head/1", Json::array({128, 0.07}), "framework.op_times.head[1]",
       "x must increase from one point to the next"},
      {"/framework/op_times/attention_forward/0", Json::array({256, -1}), "framework.op_times.attention_forward[0]",
       "seconds must be in [0, 1e6], got -1"},
      {"/framework/op_times/shapes/precision", "fp8", "framework.op_times.shapes.precision",
       "expected \"bf16\", \"mixed\" or \"fp32\", got \"fp8\""},
      {"/framework/op_times/optimiser", Json::array(), "framework.op_times.optimiser", "unknown field"},
      {"/framework/op_times/shapes/num_layers", 0, "framework.op_times.shapes.num_layers", "must be in [1, 65536], got 0"},
      {"/framework/op_times/shapes/qk_norm", 1, "framework.op_times.shapes.qk_norm", "expected true or false, got number 1"},
      {"/framework/op_times/shapes/mtp_layers", -1, "framework.op_times.shapes.mtp_layers", "must be in [0, 65536], got -1"},
      {"/framework/op_times/tensor_splits/0/tensor_parallel_degree", 1,
       "framework.op_times.tensor_splits[0].tensor_parallel_degree", "must be in [2, 4096], got 1"},
      {"/framework/op_times/tensor_splits/0/tensor_parallel_degree", 4,
       "framework.op_times.tensor_splits[0].tensor_parallel_degree", "= 4 does not divide shapes.num_key_value_heads = 2"},
      {"/framework/op_times/tensor_splits/0/head/0", Json::array({256, -1}), "framework.op_times.tensor_splits[0].head[0]",
       "seconds must be in [0, 1e6], got -1"},
      {"/framework/op_times/tensor_splits/0/router_forward", Json::array(),
       "framework.op_times.tensor_splits[0].router_forward", "unknown field"},
      {"/framework/op_times/expert_splits/0/expert_parallel_degree", 3,
       "framework.op_times.expert_splits[0].expert_parallel_degree", "= 3 does not divide shapes.num_experts = 8"},
      {"/framework/op_times/expert_splits/0/exchange_forward", Json::array({Json::array({256, -1})}),
       "framework.op_times.expert_splits[0].exchange_forward[0]", "seconds must be in [0, 1e6], got -1"},
      {"/framework/op_times/expert_splits/1", calibrated_json()["framework"]["op_times"]["expert_splits"][0],
       "framework.op_times.expert_splits[1].expert_parallel_degree", "= 2 is listed twice"},
      {"/framework/op_times/shard_splits/0/hybrid_shard_degree", 1,
       "framework.op_times.shard_splits[0].hybrid_shard_degree", "must be in [2, 65536], got 1"},
      {"/framework/op_times/shard_splits/1", calibrated_json()["framework"]["op_times"]["shard_splits"][0],
       "framework.op_times.shard_splits[1].hybrid_shard_degree", "= 2 is listed twice"},
      {"/framework/op_times/tensor_splits/1", calibrated_json()["framework"]["op_times"]["tensor_splits"][0],
       "framework.op_times.tensor_splits[1].tensor_parallel_degree", "= 2 is listed twice"},
      {"/intra_node/collectives/all_gather/points/0", Json::array({-5, 1}), "intra_node.collectives.all_gather.points[0]",
       "expected [bytes >= 1, seconds >= 0], got an array"},
      {"/intra_node/collectives/all_to_all/bandwidth_bytes_per_s", 0, "intra_node.collectives.all_to_all.bandwidth_bytes_per_s",
       "must be in [1, 1e+18], got 0"},
      {"/framework/collective_after_compute/all_gather/1", Json::array({0.0001, 0.1}),
       "framework.collective_after_compute.all_gather[1]", "compute seconds must increase from one point to the next"},
      {"/framework/collective_after_compute/all_to_all/0", Json::array({0.06, -0.1}),
       "framework.collective_after_compute.all_to_all[0]", "extra seconds must be in [0, 1e6], got -0.1"},
      {"/framework/collective_after_compute/all_to_al", Json::array(), "framework.collective_after_compute.all_to_al",
       "unknown field"},
      {"/framework/comm_overlaps_compute", "no", "framework.comm_overlaps_compute", "expected true or false, got string \"no\""},
      {"/framework/overlap_gradient_sync", 1, "framework.overlap_gradient_sync", "expected true or false, got number 1"},
      {"/host/processors", -1, "host.processors", "must be in [0, 1048576], got -1"},
  };
  TempDir dir;
  for (const ProfileEditPair& edit : edits) {
    Json json = calibrated_json();
    json[Json::json_pointer(edit.pointer)] = edit.value;
    const std::string path = dir.write("cal.json", json);
    const auto problems = problems_of([&] { read_cluster_file(path); }, path);
    ASSERT_EQ(problems.size(), 1u) << edit.pointer << describe(problems);
    EXPECT_EQ(problems[0].path, edit.path) << edit.pointer;
    EXPECT_EQ(problems[0].message, edit.message) << edit.pointer;
  }
  // Whole micro-batches say nothing per block without the depth of the model they ran.
  Json json = calibrated_json();
  json["framework"]["op_times"]["shapes"].erase("num_layers");
  std::string path = dir.write("cal.json", json);
  auto problems = problems_of([&] { read_cluster_file(path); }, path);
  ASSERT_EQ(problems.size(), 4u) << describe(problems);
  EXPECT_EQ(problems[0].path, "framework.op_times.shapes.num_layers");
  EXPECT_EQ(problems[0].message, "is required with micro_batch_forward: the blocks of the model those micro-batches ran");
  EXPECT_EQ(problems[1].message, "is required with a split's micro_batch_forward: the blocks of the model it ran");
  EXPECT_EQ(problems[2].message, "is required with expert_splits: the blocks of the model they ran");
  EXPECT_EQ(problems[3].message, "is required with shard_splits: the blocks of the model they ran");
  // The recomputed whole micro-batches are priced against the plain ones: all four or neither.
  for (const char* dropped : {"recomputed_micro_batch_backward", "micro_batch_forward"}) {
    json = calibrated_json();
    json["framework"]["op_times"].erase(dropped);
    path = dir.write("cal.json", json);
    problems = problems_of([&] { read_cluster_file(path); }, path);
    ASSERT_GE(problems.size(), 1u) << dropped << describe(problems);
    EXPECT_EQ(problems.back().path, "framework.op_times.recomputed_micro_batch_forward") << dropped;
    EXPECT_EQ(problems.back().message,
              "comes with recomputed_micro_batch_backward, micro_batch_forward and micro_batch_backward: it is priced "
              "against them")
        << dropped;
  }
  // A split's whole micro-batch is its compute and its collectives: the four come together.
  json = calibrated_json();
  json["framework"]["op_times"]["tensor_splits"][0].erase("collectives_backward");
  path = dir.write("cal.json", json);
  problems = problems_of([&] { read_cluster_file(path); }, path);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "framework.op_times.tensor_splits[0].micro_batch_forward");
  EXPECT_EQ(problems[0].message,
            "micro_batch_forward, micro_batch_backward, collectives_forward and collectives_backward come together");
  // An expert split's four curves are each required.
  json = calibrated_json();
  json["framework"]["op_times"]["expert_splits"][0].erase("exchange_backward");
  path = dir.write("cal.json", json);
  problems = problems_of([&] { read_cluster_file(path); }, path);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "framework.op_times.expert_splits[0].exchange_backward");
}

struct ProfileEdit {
  const char* pointer;
  Json value;
  const char* path;
  const char* message;
};

// Each edit of the model file `base`, written as `file` and read back, is refused with one
// problem: the edit's path and message.
void expect_each_model_edit_refused(const Json& base, const std::vector<ProfileEdit>& edits, const char* file) {
  TempDir dir;
  for (const ProfileEdit& edit : edits) {
    Json json = base;
    json[Json::json_pointer(edit.pointer)] = edit.value;
    const std::string path = dir.write(file, json);
    const auto problems = problems_of([&] { read_model_file(path); }, path);
    ASSERT_EQ(problems.size(), 1u) << edit.pointer << describe(problems);
    EXPECT_EQ(problems[0].path, edit.path) << edit.pointer;
    EXPECT_EQ(problems[0].message, edit.message) << edit.pointer;
  }
}

TEST(HardwareProfile, OneProblemEachFromAFile) {
  const std::vector<ProfileEdit> edits = {
      {"/gpu/memory_bytes/value", "40GB", "gpu.memory_bytes", "expected an integer, got string \"40GB\""},
      {"/gpu/memory_bytes", -1, "gpu.memory_bytes", "must be in [1, 1125899906842624], got -1"},
      {"/gpus_per_node/value", 0, "gpus_per_node", "must be in [1, 1024], got 0"},
      {"/gpus_per_node", 1e300, "gpus_per_node", "must be in [1, 1024], got 1e+300"},
      {"/host/memory_bytes/value", Json(uint64_t{18446744073709551615u}), "host.memory_bytes",
       "must be in [1, 1125899906842624], got 18446744073709551615"},
      {"/intra_node/latency_s/value", -1e-6, "intra_node.latency_s", "must be in [0, 1], got -1e-06"},
      {"/inter_node/bandwidth_bytes_per_s", "fast", "inter_node.bandwidth_bytes_per_s",
       "expected a number, got string \"fast\""},
      {"/framework/fragmentation_factor/value", 0.9, "framework.fragmentation_factor", "must be in [1, 4], got 0.9"},
      {"/framework/kernels/value", "flash", "framework.kernels", "expected one of \"fused\", \"eager\", got string \"flash\""},
      {"/gpu/memory_byte", 1, "gpu.memory_byte", "unknown field"},
      {"/gpu/streaming_multiprocessors/value", -1, "gpu.streaming_multiprocessors", "must be in [1, 65536], got -1"},
      {"/gpu/matmul_peak_efficiency/value", 1.5, "gpu.matmul_peak_efficiency", "must be in [0.01, 1], got 1.5"},
      {"/gpu/flash_attention_efficiency/value", "high", "gpu.flash_attention_efficiency",
       "expected a number, got string \"high\""},
      {"/schema_version", 2, "schema_version", "must be in [1, 1], got 2"},
      {"/intra_node", "NVSwitch", "intra_node", "expected an object, got string \"NVSwitch\""},
      // Consistency checks run once every field has been read.
      {"/gpu/peak_fp32_flops/value", 400e12, "gpu.peak_fp32_flops",
       "exceeds gpu.peak_bf16_flops; the two are probably swapped"},
      {"/framework/headroom_bytes/value", int64_t{42949672960}, "framework",
       "headroom_bytes + overhead_bytes (44560285696) leave no device memory of gpu.memory_bytes = 42949672960"},
  };
  TempDir dir;
  for (const ProfileEdit& edit : edits) {
    Json json = p4d_json();
    const Json::json_pointer at(edit.pointer);
    ASSERT_TRUE(json.contains(at.parent_pointer())) << edit.pointer;
    json[at] = edit.value;
    const std::string path = dir.write("p4d.json", json);
    const auto problems = problems_of([&] { read_cluster_file(path); }, path);
    ASSERT_EQ(problems.size(), 1u) << edit.pointer << describe(problems);
    EXPECT_EQ(problems[0].path, edit.path) << edit.pointer;
    EXPECT_EQ(problems[0].message, edit.message) << edit.pointer;
  }
}

TEST(HardwareProfile, EveryProblemIsReported) {
  Json json = p4d_json();
  json["gpu"]["memory_bytes"]["value"] = "40GB";
  json["gpu"]["memory_byte"] = 1;
  json["intra_node"]["latency_s"] = -1;
  json.erase("host");
  json["owner"] = "me";
  const auto problems = problems_of([&] { cluster_from_json(json, "p4d.json"); }, "p4d.json");
  const std::vector<std::string> paths = {"gpu.memory_bytes", "gpu.memory_byte", "intra_node.latency_s", "host",
                                          "owner"};
  ASSERT_EQ(problems.size(), paths.size()) << describe(problems);
  for (size_t i = 0; i < paths.size(); ++i) EXPECT_EQ(problems[i].path, paths[i]) << i;
  EXPECT_EQ(problems[3].message, "missing required field");
}

TEST(HardwareProfile, MissingAndTruncatedFiles) {
  TempDir dir;
  const std::string missing = dir.file("p9.json");
  EXPECT_EQ(problems_of([&] { read_cluster_file(missing); }, missing).at(0).message, "cannot open file");
  const std::string text = read_text(profile_path("hardware/p5.48xlarge.json"));
  const std::string truncated = dir.write("p5.json", text.substr(0, text.find("\"intra_node\"")));
  const auto problems = problems_of([&] { read_cluster_file(truncated); }, truncated);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].message.rfind("not valid JSON (", 0), 0u) << problems[0].message;
}

// Every field read in the {"value", "source"} form keeps its source through a write and a read,
// strings and counts as well as rates.
TEST(HardwareProfile, SourcesSurviveARoundTrip) {
  for (const char* pointer : {"/num_nodes", "/name", "/intra_node/fabric"}) {
    Json json = p4d_json();
    const Json::json_pointer at(pointer);
    const Json plain = json.contains(at) ? json[at] : Json(1);
    json[at] = Json{{"value", plain}, {"source", "fuzz"}};
    const ClusterSpec c = cluster_from_json(json, "p4d.json");
    const ClusterSpec again = cluster_from_json(Json::parse(to_json(c).dump()), "again");
    EXPECT_EQ(again.sources.size(), c.sources.size()) << pointer;
    EXPECT_TRUE(again == c) << pointer;
  }
}

// ---------------------------------------------------------------------------------------------
// Model profiles and Hugging Face config.json files

TEST(ModelProfile, ProblemsFromAFile) {
  const Json base = Json::parse(read_text(profile_path("models/mixtral-8x7b.json")));
  const std::vector<ProfileEdit> edits = {
      {"/num_experts", "eight", "num_experts", "expected an integer, got string \"eight\""},
      {"/num_layers", 0, "num_layers", "must be in [1, 4096], got 0"},
      {"/hidden_size", 1e300, "hidden_size", "must be in [1, 16777216], got 1e+300"},
      {"/vocab_size", Json(uint64_t{18446744073709551615u}), "vocab_size",
       "must be in [1, 16777216], got 18446744073709551615"},
      {"/rope_theta", 0.5, "rope_theta", "must be in [1, 1e+12], got 0.5"},
      {"/tie_word_embeddings", "false", "tie_word_embeddings", "expected true or false, got string \"false\""},
      {"/num_expert", 8, "num_expert", "unknown field"},
      {"/schema_version", 0, "schema_version", "must be in [1, 1], got 0"},
      // The model rules run after a clean read, with the field names of the profile.
      {"/num_key_value_heads", 5, "num_key_value_heads", "= 5 does not divide num_attention_heads = 32"},
      {"/head_dim", 127, "head_dim", "= 127 is odd; rotary embeddings rotate pairs of dimensions"},
  };
  expect_each_model_edit_refused(base, edits, "model.json");
}

TEST(ModelProfile, ShippedProfilesRoundTrip) {
  for (const char* name : {"mixtral-8x7b", "mixtral-8x22b", "mixtral-tiny", "qwen3-30b-a3b", "qwen3-235b-a22b",
                           "qwen2-57b-a14b", "deepseek-moe-16b", "deepseek-v2-lite", "deepseek-v3", "gpt-oss-20b",
                           "gpt-oss-120b", "moonlight-16b-a3b", "kimi-k2"}) {
    const ModelSpec m = read_model_file(profile_path(std::string("models/") + name + ".json"));
    EXPECT_EQ(m.name, name);
    EXPECT_EQ(model_from_json(Json::parse(to_json(m).dump()), "again"), m) << name;
  }
}

// mistralai/Mixtral-8x7B-v0.1 config.json as published on the Hugging Face hub.
Json hf_config() { return parse_json_text(read_text(data_path("hf/mixtral-8x7b/config.json")), "config.json"); }

TEST(HfConfig, FileIsRecognisedByModelType) {
  TempDir dir;
  const std::string path = dir.write("config.json", hf_config());
  const ModelSpec m = read_model_file(path);
  EXPECT_EQ(m.num_layers, 32);
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_EQ(m.name, "hf-mixtral");
  EXPECT_EQ(m.source, "Hugging Face config.json (" + path + ")");
  EXPECT_EQ(count_parameters(m).total(), count_parameters(read_model_file(profile_path("models/mixtral-8x7b.json"))).total());
}

// The config.json moeplan writes for a model reads back as the same model; its fields are the
// published Mixtral config's (no field our reader would not know).
TEST(HfConfig, WrittenConfigReadsBackAsTheSameModel) {
  for (const char* name : {"mixtral-8x7b", "mixtral-8x22b", "mixtral-tiny"}) {
    const ModelSpec m = read_model_file(profile_path(std::string("models/") + name + ".json"));
    const Json config = to_hf_config(m, "bfloat16");
    ModelSpec back = model_from_hf_config(Json::parse(config.dump()), "config.json");
    EXPECT_EQ(back.name, m.name);
    back.source = m.source;
    EXPECT_EQ(back, m) << name;
  }
  const Json published = hf_config();
  const Json ours = to_hf_config(read_model_file(profile_path("models/mixtral-8x7b.json")), "bfloat16");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "rope_theta",
                          "rms_norm_eps", "tie_word_embeddings", "model_type", "hidden_act", "torch_dtype"})
    EXPECT_EQ(Json::parse(ours[key].dump()), published[key]) << key;
}

TEST(HfConfig, ProblemsFromAFile) {
  const std::vector<ProfileEdit> edits = {
      {"/num_local_experts", "eight", "num_local_experts", "expected an integer, got string \"eight\""},
      {"/num_hidden_layers", 0, "num_hidden_layers", "must be in [1, 4096], got 0"},
      {"/num_attention_heads", -32, "num_attention_heads", "must be in [1, 16777216], got -32"},
      {"/vocab_size", 1e300, "vocab_size", "must be in [1, 16777216], got 1e+300"},
      {"/intermediate_size", Json(uint64_t{18446744073709551615u}), "intermediate_size",
       "must be in [1, 16777216], got 18446744073709551615"},
      {"/rms_norm_eps", "1e-5", "rms_norm_eps", "expected a number, got string \"1e-5\""},
      {"/sliding_window", 0, "sliding_window", "must be in [1, 16777216], got 0"},
      {"/head_dim", 127.5, "head_dim", "expected an integer, got number 127.5"},
      {"/num_local_expert", 16, "num_local_expert", "unknown field"},
      {"/model_type", "gpt2", "model_type",
       "expected \"mixtral\", \"qwen2_moe\", \"qwen3_moe\", \"deepseek\", \"deepseek_v2\", \"deepseek_v3\", \"kimi_k2\", \"gpt_oss\" or \"llama\", got \"gpt2\""},
      {"/hidden_act", "gelu", "hidden_act", "only \"silu\" (SwiGLU feed-forward) is supported, got \"gelu\""},
      {"/num_key_value_heads", 5, "num_key_value_heads", "= 5 does not divide num_attention_heads = 32"},
  };
  TempDir dir;
  for (const ProfileEdit& edit : edits) {
    Json json = hf_config();
    json[Json::json_pointer(edit.pointer)] = edit.value;
    const std::string path = dir.write("config.json", json);
    const auto problems = problems_of([&] { read_model_file(path); }, path);
    ASSERT_FALSE(problems.empty()) << edit.pointer;
    EXPECT_EQ(problems[0].path, edit.path) << edit.pointer << describe(problems);
    EXPECT_EQ(problems[0].message, edit.message) << edit.pointer;
    EXPECT_EQ(problems.size(), 1u) << edit.pointer << describe(problems);
  }
}

// Qwen3-MoE and Qwen2-MoE configs as published on the Hugging Face hub read as the shipped
// profiles, whose parameter counts are the model cards' (total and active).
TEST(HfConfig, QwenMoeConfigsReadAsTheShippedProfiles) {
  struct Case {
    const char* config;
    const char* profile;
    double total, active;  // the model card's, in billions
  };
  for (const Case& c : {Case{"hf/qwen3-30b-a3b/config.json", "models/qwen3-30b-a3b.json", 30.5, 3.3},
                        Case{"hf/qwen2-57b-a14b/config.json", "models/qwen2-57b-a14b.json", 57.4, 14.2},
                        Case{"hf/deepseek-moe-16b/config.json", "models/deepseek-moe-16b.json", 16.4, 2.8}}) {
    SCOPED_TRACE(c.config);
    ModelSpec hf = read_model_file(data_path(c.config));
    const ModelSpec profile = read_model_file(profile_path(c.profile));
    hf.name = profile.name;
    hf.source = profile.source;
    EXPECT_EQ(hf, profile);
    const ParamCounts p = count_parameters(profile);
    EXPECT_NEAR(static_cast<double>(p.total()) / 1e9, c.total, 0.1);
    EXPECT_NEAR(static_cast<double>(p.active()) / 1e9, c.active, 0.1);
  }
  const ParamCounts big = count_parameters(read_model_file(profile_path("models/qwen3-235b-a22b.json")));
  EXPECT_NEAR(static_cast<double>(big.total()) / 1e9, 235.1, 0.5);
  EXPECT_NEAR(static_cast<double>(big.active()) / 1e9, 22.1, 0.2);
}

// What a Qwen config says that moeplan does not model is refused naming the field; fields that
// change neither time nor memory are read and dropped.
TEST(HfConfig, QwenFieldsMoeplanDoesNotModelAreNamed) {
  const Json qwen3 = parse_json_text(read_text(data_path("hf/qwen3-30b-a3b/config.json")), "config.json");
  const std::vector<ProfileEdit> edits = {
      {"/mlp_only_layers", Json::array({0, 1}), "mlp_only_layers",
       "= [0,1]: dense layers among MoE layers are not modelled yet"},
      {"/use_sliding_window", true, "use_sliding_window", "= true: a sliding window on some layers is not modelled yet"},
      {"/attention_bias", true, "attention_bias", "= true: biases on Qwen3's attention projections are not modelled"},
      {"/num_nextn_predict_layers", 1, "num_nextn_predict_layers", "unknown field"},
      {"/num_experts_per_tok", 129, "num_experts_per_tok", "= 129 exceeds num_experts = 128"},
  };
  expect_each_model_edit_refused(qwen3, edits, "config.json");
  Json accepted = qwen3;
  accepted["rope_scaling"] = Json::object({{"type", "yarn"}, {"factor", 4.0}});
  EXPECT_EQ(model_from_hf_config(accepted, "config.json"), model_from_hf_config(qwen3, "config.json"));
  // Whether the chosen experts' weights are renormalised: as the config says, else not
  // (Qwen3MoeConfig's default); written back as it was read.
  EXPECT_TRUE(model_from_hf_config(qwen3, "config.json").norm_topk_prob);
  Json unsaid = qwen3;
  unsaid.erase("norm_topk_prob");
  const ModelSpec unnormalised = model_from_hf_config(unsaid, "config.json");
  EXPECT_FALSE(unnormalised.norm_topk_prob);
  EXPECT_EQ(to_hf_config(unnormalised, "bfloat16")["norm_topk_prob"], false);
  // A Qwen3-MoE profile is written as a Qwen3MoeConfig and read back as itself; a Qwen2-MoE one
  // (a gated shared expert, q/k/v biases) has no config class moeplan writes.
  const ModelSpec profile = read_model_file(profile_path("models/qwen3-30b-a3b.json"));
  const Json written = to_hf_config(profile, "bfloat16");
  EXPECT_EQ(written["architectures"], Json::array({"Qwen3MoeForCausalLM"}));
  ModelSpec back = model_from_hf_config(written, "config.json");
  EXPECT_EQ(back.name, profile.name);
  back.source = profile.source;
  EXPECT_EQ(back, profile);
  EXPECT_THROW(to_hf_config(read_model_file(profile_path("models/qwen2-57b-a14b.json")), "bfloat16"), InputError);
  // Mixtral's class always renormalises.
  ModelSpec mixtral = read_model_file(profile_path("models/mixtral-8x7b.json"));
  mixtral.norm_topk_prob = false;
  EXPECT_THROW(to_hf_config(mixtral, "bfloat16"), InputError);
}

// DeepSeek-V3's blocks are written as a DeepseekV3Config (the shipped V3, Kimi K2, Moonlight and
// deepseek-v3-tiny profiles) and read back as the same model; DeepSeek-V2-Lite's softmax router,
// a gated shared expert or a shared width that is no multiple of the routed one has no such
// config.
TEST(HfConfig, DeepSeekV3ProfilesWriteConfigsThatReadBack) {
  for (const char* name : {"deepseek-v3", "kimi-k2", "moonlight-16b-a3b", "deepseek-v3-tiny"}) {
    SCOPED_TRACE(name);
    const ModelSpec m = read_model_file(profile_path(std::string("models/") + name + ".json"));
    const Json config = to_hf_config(m, "bfloat16");
    EXPECT_EQ(config["architectures"], Json::array({"DeepseekV3ForCausalLM"}));
    EXPECT_EQ(config["qk_nope_head_dim"].get<int64_t>() + config["qk_rope_head_dim"].get<int64_t>(), m.head_dim);
    ModelSpec back = model_from_hf_config(Json::parse(config.dump()), "config.json");
    EXPECT_EQ(back.name, m.name);
    back.source = m.source;
    back.mtp_loss_weight = m.mtp_loss_weight;  // a training setting no config.json holds
    EXPECT_EQ(back, m);
  }
  ModelSpec m = read_model_file(profile_path("models/deepseek-v3.json"));
  EXPECT_THROW(to_hf_config(read_model_file(profile_path("models/deepseek-v2-lite.json")), "bfloat16"), InputError);
  m.shared_expert_gate = true;
  EXPECT_THROW(to_hf_config(m, "bfloat16"), InputError);
  m.shared_expert_gate = false;
  m.shared_expert_intermediate_size = 3000;
  EXPECT_THROW(to_hf_config(m, "bfloat16"), InputError);
  // Rotary pairs in halves are not what DeepSeek's checkpoints hold.
  Json config = to_hf_config(read_model_file(profile_path("models/deepseek-v3.json")), "bfloat16");
  config["rope_interleave"] = false;
  EXPECT_THROW(model_from_hf_config(config, "config.json"), InputError);
}

// DeepSeek-V2 and V3 configs: latent attention, group-limited routing, sigmoid scores and
// multi-token prediction (V3). Each reads as its shipped profile: V3 has the report's 671B
// parameters (37B active) and its multi-token prediction module 11.6B more (one MoE block of
// 11.5B and a 7168 x 14336 projection; the report's 14B counts the module's own embedding and
// head, which training shares).
TEST(HfConfig, DeepseekV2AndV3ReadAsTheShippedProfiles) {
  struct Case {
    const char* config;
    const char* profile;
    double total, active;  // billions; active counts the embedding, which the model cards leave out
  };
  for (const Case& c : {Case{"hf/deepseek-v2-lite/config.json", "models/deepseek-v2-lite.json", 15.7, 2.66},
                        Case{"hf/deepseek-v3/config.json", "models/deepseek-v3.json", 682.6, 38.24},
                        Case{"hf/moonlight-16b-a3b/config.json", "models/moonlight-16b-a3b.json", 16.0, 2.94}}) {
    SCOPED_TRACE(c.config);
    const Json config = parse_json_text(read_text(data_path(c.config)), "config.json");
    ModelSpec hf = model_from_hf_config(config, "config.json");
    const ModelSpec profile = read_model_file(profile_path(c.profile));
    hf.name = profile.name;
    hf.source = profile.source;
    EXPECT_EQ(hf, profile);
    const ParamCounts p = count_parameters(profile);
    EXPECT_NEAR(static_cast<double>(p.total()) / 1e9, c.total, 0.05);
    EXPECT_NEAR(static_cast<double>(p.active()) / 1e9, c.active, 0.05);
  }
  Json v3 = parse_json_text(read_text(data_path("hf/deepseek-v3/config.json")), "config.json");
  // Kimi K2's config names DeepSeek-V3's architecture kimi_k2.
  Json kimi = v3;
  kimi["model_type"] = "kimi_k2";
  EXPECT_EQ(model_from_hf_config(kimi, "config.json"), model_from_hf_config(v3, "config.json"));
  EXPECT_NEAR(static_cast<double>(count_parameters(read_model_file(profile_path("models/kimi-k2.json"))).total()) / 1e9,
              1026.4, 0.05);
  ModelSpec without = read_model_file(profile_path("models/deepseek-v3.json"));
  without.mtp_layers = 0;
  EXPECT_NEAR(static_cast<double>(count_parameters(without).total()) / 1e9, 671.0, 0.05);
  EXPECT_NEAR(static_cast<double>(count_parameters(without).active()) / 1e9, 37.55, 0.05);
  Json two = v3;
  two["num_nextn_predict_layers"] = 2;
  EXPECT_EQ(model_from_hf_config(two, "config.json").mtp_layers, 2);
  const std::vector<ProfileEdit> edits = {
      {"/num_nextn_predict_layers", -1, "num_nextn_predict_layers", "must be in [0, 4096], got -1"},
      {"/scoring_func", "tanh", "scoring_func", "expected \"softmax\" or \"sigmoid\", got \"tanh\""},
      {"/topk_method", "random", "topk_method",
       "expected \"greedy\", \"group_limited_greedy\" or \"noaux_tc\", got \"random\""},
      {"/n_group", 7, "n_group", "= 7 does not divide num_experts = 256"},
      {"/qk_rope_head_dim", 63, "qk_rope_head_dim",
       "= 63 must be even, at least 2 and less than head_dim = 191 (a head's query and key: qk_nope_head_dim + "
       "qk_rope_head_dim)"},
  };
  expect_each_model_edit_refused(v3, edits, "config.json");
}

// GPT-OSS: blocks alternating a 128-token window and full attention, sinks, biases, the clamped
// gate; the 120B config reads as the shipped profile (the model card's 116.83B). A pattern of
// windows other than every K-th block full, or two top-k that disagree, is refused by name.
TEST(HfConfig, GptOssReadsAsTheShippedProfile) {
  const Json config = parse_json_text(read_text(data_path("hf/gpt-oss-120b/config.json")), "config.json");
  ModelSpec hf = model_from_hf_config(config, "config.json");
  const ModelSpec profile = read_model_file(profile_path("models/gpt-oss-120b.json"));
  hf.name = profile.name;
  hf.source = profile.source;
  EXPECT_EQ(hf, profile);
  EXPECT_EQ(hf.full_attention_step, 2);
  EXPECT_NEAR(static_cast<double>(count_parameters(profile).total()) / 1e9, 116.83, 0.01);
  EXPECT_NEAR(static_cast<double>(count_parameters(read_model_file(profile_path("models/gpt-oss-20b.json"))).total()) / 1e9,
              20.91, 0.01);
  Json all_windowed = config;
  for (Json& t : all_windowed["layer_types"]) t = "sliding_attention";
  EXPECT_EQ(model_from_hf_config(all_windowed, "config.json").full_attention_step, 0);
  const std::vector<ProfileEdit> edits = {
      {"/layer_types/2", "full_attention", "layer_types",
       "expected 36 of \"sliding_attention\" and \"full_attention\", full attention on every K-th block (blocks K-1, "
       "2K-1, ...) or none: another pattern is not modelled"},
      {"/experts_per_token", 2, "experts_per_token", "= 2 differs from num_experts_per_tok = 4"},
      {"/swiglu_limit", -1, "swiglu_limit", "must be in [0, 1e+06], got -1"},
  };
  expect_each_model_edit_refused(config, edits, "config.json");
}

// DeepSeekMoE's first_k_dense_replace and moe_layer_freq place its dense blocks; what it says
// that moeplan does not model is refused by its own name.
TEST(HfConfig, DeepseekMoeDenseBlocksAndRefusals) {
  const Json config = parse_json_text(read_text(data_path("hf/deepseek-moe-16b/config.json")), "config.json");
  const ModelSpec m = model_from_hf_config(config, "config.json");
  EXPECT_FALSE(m.moe_layer(0));
  EXPECT_TRUE(m.moe_layer(1));
  EXPECT_EQ(m.moe_layers(), 27);
  EXPECT_EQ(m.shared_expert_intermediate_size, 2 * 1408);
  Json every_other = config;
  every_other["moe_layer_freq"] = 2;  // blocks 2, 4, 6, ... (block % 2 == 0 from block 1 on)
  const ModelSpec e = model_from_hf_config(every_other, "config.json");
  EXPECT_FALSE(e.moe_layer(1));
  EXPECT_TRUE(e.moe_layer(2));
  EXPECT_EQ(e.moe_layers(), 13);
  const std::vector<ProfileEdit> edits = {
      {"/scoring_func", "sigmoid", "scoring_func", "= \"sigmoid\": only softmax routing is modelled for DeepSeekMoE"},
      {"/attention_bias", true, "attention_bias", "= true: biases on DeepSeek's attention projections are not modelled"},
      {"/first_k_dense_replace", 28, "first_k_dense_replace",
       "= 28 with moe_layer_step = 1 leaves no MoE block among num_layers = 28"},
      {"/kv_lora_rank", 512, "kv_lora_rank", "unknown field"},
  };
  expect_each_model_edit_refused(config, edits, "config.json");
}

// decoder_sparse_step K: blocks K-1, 2K-1, ... have experts, the others are dense blocks of
// intermediate_size (transformers' Qwen2MoeDecoderLayer).
TEST(HfConfig, QwenSparseStepPlacesDenseBlocks) {
  Json qwen3 = parse_json_text(read_text(data_path("hf/qwen3-30b-a3b/config.json")), "config.json");
  qwen3["decoder_sparse_step"] = 2;
  const ModelSpec m = model_from_hf_config(qwen3, "config.json");
  EXPECT_EQ(m.moe_layer_step, 2);
  EXPECT_EQ(m.moe_layer_offset, 1);
  EXPECT_EQ(m.dense_intermediate_size, 6144);
  EXPECT_EQ(m.intermediate_size, 768);
  EXPECT_FALSE(m.moe_layer(0));
  EXPECT_TRUE(m.moe_layer(1));
  EXPECT_EQ(m.moe_layers(), 24);
  // Half the blocks lose 128 experts of 3 x 2048 x 768 and the router, and gain a dense
  // feed-forward layer of 3 x 2048 x 6144.
  const ParamCounts all = count_parameters(model_from_hf_config(
      parse_json_text(read_text(data_path("hf/qwen3-30b-a3b/config.json")), "config.json"), "config.json"));
  const ParamCounts half = count_parameters(m);
  EXPECT_EQ(all.total() - half.total(), int64_t{24} * (128 * 3 * 2048 * 768 + 2048 * 128 - 3 * 2048 * 6144));
  // Read back from moeplan's own profile format, it is the same model.
  EXPECT_EQ(model_from_json(to_json(m), "profile"), m);
  // A Mixtral config.json cannot say which blocks are dense.
  EXPECT_THROW(to_hf_config(m, "bfloat16"), InputError);
}

TEST(ModelProfile, SharedExpertFieldsAreChecked) {
  Json json = Json::parse(read_text(profile_path("models/mixtral-8x7b.json")));
  json["shared_expert_gate"] = true;
  TempDir dir;
  auto problems = problems_of([&] { read_model_file(dir.write("m.json", json)); }, dir.file("m.json"));
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "shared_expert_gate");
  EXPECT_EQ(problems[0].message, "= true without shared experts (shared_expert_intermediate_size = 0)");
  json.erase("shared_expert_gate");
  json["num_experts"] = 1;
  json["experts_per_token"] = 1;
  json["shared_expert_intermediate_size"] = 1024;
  problems = problems_of([&] { read_model_file(dir.write("m.json", json)); }, dir.file("m.json"));
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "shared_expert_intermediate_size");
}

// Rule problems of a Hugging Face config name the config's own fields (num_experts_per_tok,
// num_hidden_layers), not moeplan's.
TEST(HfConfig, RuleProblemsNameTheConfigFields) {
  Json top_k = hf_config();
  top_k["num_experts_per_tok"] = 9;
  const auto top_k_problems = problems_of([&] { model_from_hf_config(top_k, "config.json"); }, "config.json");
  ASSERT_EQ(top_k_problems.size(), 1u) << describe(top_k_problems);
  EXPECT_EQ(top_k_problems[0].path, "num_experts_per_tok");
  EXPECT_EQ(top_k_problems[0].message, "= 9 exceeds num_experts = 8");

  // hidden 2^24 (so head_dim 2^19): attention alone is 32 x 4 x 2^24 x 2^24 = 3.6e16 > 1e15.
  Json huge = hf_config();
  huge["hidden_size"] = 16777216;
  const auto huge_problems = problems_of([&] { model_from_hf_config(huge, "config.json"); }, "config.json");
  ASSERT_EQ(huge_problems.size(), 1u) << describe(huge_problems);
  EXPECT_EQ(huge_problems[0].path, "num_hidden_layers");
}

// Without head_dim, hidden_size / heads is used; more heads than hidden units would make it 0,
// which must be refused rather than written back as a model no reader accepts.
TEST(HfConfig, DerivedHeadDimOfZeroIsRejected) {
  Json hf = hf_config();
  hf["num_attention_heads"] = 8192;  // > hidden_size = 4096; 8 KV heads still divide it
  EXPECT_THROW(
      {
        const ModelSpec m = model_from_hf_config(hf, "config.json");
        std::printf("accepted with head_dim = %lld\n", static_cast<long long>(m.head_dim));
      },
      InputError);

  Json profile_json = Json::parse(read_text(profile_path("models/mixtral-8x7b.json")));
  profile_json.erase("head_dim");
  profile_json["num_attention_heads"] = 8192;
  EXPECT_THROW(model_from_json(profile_json, "model.json"), InputError);
}

TEST(HfConfig, EveryProblemIsReported) {
  Json json = hf_config();
  json["num_local_experts"] = "eight";
  json["hidden_act"] = "relu";
  json["num_hidden_layers"] = -1;
  json["rope_scalling"] = nullptr;
  const auto problems = problems_of([&] { model_from_hf_config(json, "config.json"); }, "config.json");
  const std::vector<std::string> paths = {"num_hidden_layers", "num_local_experts", "hidden_act", "rope_scalling"};
  ASSERT_EQ(problems.size(), paths.size()) << describe(problems);
  for (size_t i = 0; i < paths.size(); ++i) EXPECT_EQ(problems[i].path, paths[i]) << i;
}

TEST(HfConfig, TruncatedAndMissingFiles) {
  TempDir dir;
  const std::string text = hf_config().dump(2);
  const std::string truncated = dir.write("config.json", text.substr(0, text.size() - 2));
  const auto problems = problems_of([&] { read_model_file(truncated); }, truncated);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].message.rfind("not valid JSON (", 0), 0u) << problems[0].message;
  const std::string missing = dir.file("absent/config.json");
  EXPECT_EQ(problems_of([&] { read_model_file(missing); }, missing).at(0).message, "cannot open file");
}

// The limit counts objects and arrays: kMaxJsonDepth levels are read, one more is not, whether
// the innermost is empty or holds a value.
TEST(ParseJsonText, NestingOfExactlyTheLimitIsRead) {
  const auto arrays = [](int depth, const std::string& inner) {
    return std::string(static_cast<size_t>(depth), '[') + inner + std::string(static_cast<size_t>(depth), ']');
  };
  for (const std::string inner : {"", "1"}) {
    EXPECT_EQ(json_nesting_depth(arrays(kMaxJsonDepth, inner)), kMaxJsonDepth);
    EXPECT_NO_THROW(parse_json_text(arrays(kMaxJsonDepth, inner), "t.json")) << inner;
    const auto problems = problems_of([&] { parse_json_text(arrays(kMaxJsonDepth + 1, inner), "t.json"); }, "t.json");
    ASSERT_EQ(problems.size(), 1u) << inner;
    EXPECT_EQ(problems[0].message, "nested deeper than 128 levels");
  }
}

// Brackets inside strings, escaped quotes included, are not nesting; text that is not JSON is
// measured as far as it goes.
TEST(JsonNestingDepth, CountsContainersOutsideStrings) {
  EXPECT_EQ(json_nesting_depth(""), 0);
  EXPECT_EQ(json_nesting_depth("1"), 0);
  EXPECT_EQ(json_nesting_depth("[]"), 1);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": []}], "c": {}})"), 4);
  EXPECT_EQ(json_nesting_depth(R"(["[[[", "{{", "\"[[[", "\\", [0]])"), 2);
  EXPECT_EQ(json_nesting_depth(R"([[]] [[[]]])"), 3);
  EXPECT_EQ(json_nesting_depth("]]]["), 1);
  EXPECT_EQ(json_nesting_depth(R"([[ "unterminated [[[[)"), 2);
}

// Many objects in one array, as a trace holds, parse to the same document the text was.
TEST(ParseJsonText, ArrayOfManyObjectsRoundTrips) {
  Json events = Json::array();
  for (int i = 0; i < 20'000; ++i) events.push_back({{"name", "op" + std::to_string(i)}, {"ts", i}, {"args", {{"b", i}}}});
  const Json doc = {{"traceEvents", events}};
  EXPECT_EQ(parse_json_text(doc.dump(), "t.json"), doc);
}

// Found by fuzzing (fuzz/, the trace and plan targets): objects nested 20,000 deep, 120 KB of
// text, ran the parser out of stack (nlohmann copies a nested value recursively when the object
// holding it grows). Nesting is refused past kMaxJsonDepth, as any reader sees it.
TEST(ParseJsonText, NestingDeeperThanTheLimitIsAnInputError) {
  auto nested = [](int depth) {
    std::string text;
    for (int i = 0; i < depth; ++i) text += R"({"a": )";
    text += "1";
    for (int i = 0; i < depth; ++i) text += "}";
    return R"({"schema_version": 1, "model": )" + text + R"(, "after": 2})";
  };
  EXPECT_EQ(parse_json_text(nested(100), "t.json")["after"], 2);
  const auto problems = problems_of([&] { parse_json_text(nested(20'000), "t.json"); }, "t.json");
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].message, "nested deeper than 128 levels");
  TempDir dir;
  const std::string path = dir.write("cluster.json", nested(20'000));
  EXPECT_EQ(problems_of([&] { read_cluster_file(path); }, path).at(0).message, "nested deeper than 128 levels");
}

}  // namespace
}  // namespace moeplan
