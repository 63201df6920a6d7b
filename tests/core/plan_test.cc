#include "moeplan/core/plan.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "moeplan/core/rules.h"
#include "moeplan/planner/search.h"
#include "test_support.h"

namespace moeplan {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// The plan `moeplan search --gpus 16` makes: Mixtral 8x7B on two p4d.24xlarge nodes.
const Plan& searched_plan() {
  static const Plan plan = [] {
    const ModelSpec& model = test::model("mixtral-8x7b");
    const ClusterSpec cluster = test::hardware("p4d.24xlarge", 16);
    planner::SearchOptions options = test::search_options(16);
    options.moe.aux_loss_coef = model.router_aux_loss_coef;
    // An [R, S, E] plan, which the edits below take apart (tensor_pipeline_plan has T and P).
    options.pins.tensor_parallel_degree = 1;
    options.pins.pipeline_parallel_degree = 1;
    const planner::SearchResult result = planner::search(model, cluster, options);
    if (result.ranked.empty()) throw std::runtime_error("no plan for 16 GPUs");
    return planner::make_plan(model, cluster, options, result, "moeplan search --gpus 16");
  }();
  return plan;
}

const std::string& plan_text() {
  static const std::string text = plan_to_text(searched_plan());
  return text;
}

Json plan_json() { return parse_json_text(plan_text(), "plan.json"); }

std::string describe(const std::vector<Diagnostic>& diagnostics) {
  std::string text;
  for (const Diagnostic& d : diagnostics) text += "\n  " + d.to_string();
  return text;
}

// The diagnostics plan_from_json reports for json; fails the test if it accepts the plan.
std::vector<Diagnostic> plan_problems(const Json& json) {
  try {
    plan_from_json(json, "plan.json");
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), "plan.json");
    return e.diagnostics();
  }
  ADD_FAILURE() << "plan_from_json accepted the plan";
  return {};
}

std::vector<Diagnostic> plan_file_problems(const std::string& path) {
  try {
    read_plan_file(path);
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), path);
    return e.diagnostics();
  }
  ADD_FAILURE() << "read_plan_file accepted " << path;
  return {};
}

TEST(Plan, SearchedPlanIsTheExpectedShape) {
  const Plan& plan = searched_plan();
  EXPECT_EQ(plan.schema_version, kPlanSchemaVersion);
  EXPECT_EQ(plan.parallel.world_size, 16);
  EXPECT_EQ(plan.cluster.num_nodes, 2);
  EXPECT_EQ(plan.training.global_batch_tokens, 4'194'304);
  EXPECT_FALSE(plan.alternatives.empty());
  EXPECT_EQ(plan.provenance.command, "moeplan search --gpus 16");
  EXPECT_TRUE(validate({plan.model, plan.cluster, plan.parallel, plan.moe, plan.training}).empty());
}

TEST(Plan, RoundTripsThroughText) {
  const Plan& plan = searched_plan();
  const Plan back = plan_from_json(parse_json_text(plan_text(), "plan.json"), "plan.json");
  EXPECT_TRUE(back == plan);
  // Field by field, so that a failure says which part differs.
  EXPECT_EQ(back.model, plan.model);
  EXPECT_EQ(back.cluster, plan.cluster);
  EXPECT_EQ(back.cluster.sources, plan.cluster.sources);
  EXPECT_EQ(back.parallel, plan.parallel);
  EXPECT_EQ(back.moe, plan.moe);
  EXPECT_EQ(back.training, plan.training);
  EXPECT_EQ(back.prediction, plan.prediction);
  EXPECT_EQ(back.alternatives, plan.alternatives);
  EXPECT_EQ(back.provenance, plan.provenance);
  // Writing what was read gives the same bytes.
  EXPECT_EQ(plan_to_text(back), plan_text());
}

// T = 2 with sequence parallelism, P = 2, tensor groups across the expert dimension: the
// fields and a five-letter placement survive the round trip.
TEST(Plan, TensorAndPipelineParallelPlanRoundTrips) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p4d.24xlarge", 16);
  planner::SearchOptions options = test::search_options(16);
  options.pins.tensor_parallel_degree = 2;
  options.pins.pipeline_parallel_degree = 2;
  options.pins.sequence_parallel = true;
  options.pins.placement = "PRSTE";
  const planner::SearchResult result = planner::search(model, cluster, options);
  ASSERT_FALSE(result.ranked.empty());
  const Plan plan = planner::make_plan(model, cluster, options, result, "moeplan search --gpus 16");
  const Json json = parse_json_text(plan_to_text(plan), "plan.json");
  EXPECT_EQ(json["parallel"]["placement"], "PRSTE");
  EXPECT_EQ(json["parallel"]["sequence_parallel"], true);
  const Plan back = plan_from_json(json, "plan.json");
  EXPECT_EQ(back.parallel, plan.parallel);
  EXPECT_EQ(back.parallel.tensor_parallel_degree, 2);
  EXPECT_EQ(back.parallel.pipeline_parallel_degree, 2);
  EXPECT_TRUE(back == plan);
}

// Folded experts (ETP 1 under T = 2): the plan writes expert_tensor_parallel_degree, reads it
// back, and checks replica_degree against the mesh's E dimension (E / 2).
TEST(Plan, FoldedExpertPlanRoundTrips) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p4d.24xlarge", 16);
  planner::SearchOptions options = test::search_options(16);
  options.pins.tensor_parallel_degree = 2;
  options.pins.pipeline_parallel_degree = 1;
  options.pins.expert_parallel_degree = 8;
  options.pins.expert_tensor_parallel_degree = 1;
  options.pins.hybrid_shard_degree = 2;
  options.pins.placement = "RSE";
  const planner::SearchResult result = planner::search(model, cluster, options);
  ASSERT_FALSE(result.ranked.empty());
  const Plan plan = planner::make_plan(model, cluster, options, result, "moeplan search --gpus 16");
  Json json = parse_json_text(plan_to_text(plan), "plan.json");
  EXPECT_EQ(json["parallel"]["expert_tensor_parallel_degree"], 1);
  EXPECT_EQ(json["parallel"]["replica_degree"], 1);  // 16 / (8 / 2 x 2 x 2)
  EXPECT_TRUE(plan_from_json(json, "plan.json") == plan);
  json["parallel"]["replica_degree"] = 2;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].message,
            "2 does not equal world_size / (expert_parallel_degree / 2 folded ranks * hybrid_shard_degree * "
            "tensor_parallel_degree) = 1");
}

// Context parallelism: the plan writes context_parallel_degree and its exchange, reads them
// back, and checks replica_degree against C (the expert group spans the context ranks: E / C
// along the mesh).
TEST(Plan, ContextParallelPlanRoundTrips) {
  const ModelSpec& model = test::model("mixtral-8x7b");
  const ClusterSpec cluster = test::hardware("p4d.24xlarge", 16);
  planner::SearchOptions options = test::search_options(16);
  options.pins.context_parallel_degree = 2;
  options.pins.tensor_parallel_degree = 1;
  options.pins.pipeline_parallel_degree = 1;
  options.pins.expert_parallel_degree = 4;
  options.pins.hybrid_shard_degree = 2;
  options.pins.placement = "RSE";
  options.context_exchange = ContextExchange::kAllGather;
  options.pins.dense_shard_spans_experts = true;
  options.target = nullptr;
  options.ignore_memory_limits = true;
  const planner::SearchResult result = planner::search(model, cluster, options);
  ASSERT_FALSE(result.ranked.empty());
  const Plan plan = planner::make_plan(model, cluster, options, result, "moeplan search --gpus 16");
  Json json = parse_json_text(plan_to_text(plan), "plan.json");
  EXPECT_EQ(json["parallel"]["context_parallel_degree"], 2);
  EXPECT_EQ(json["parallel"]["context_exchange"], "all_gather");
  // The dense parameters over S2 x the mesh's E2 x C2.
  EXPECT_EQ(json["parallel"]["dense_shard_spans_experts"], true);
  EXPECT_EQ(plan.parallel.dense_shard_degree(), 8);
  EXPECT_EQ(plan.parallel.expert_shard_degree(), 2);
  EXPECT_EQ(json["parallel"]["placement"], "RSE");
  EXPECT_EQ(json["parallel"]["replica_degree"], 2);  // 16 / (4 / 2 x 2 x 2)
  EXPECT_TRUE(plan_from_json(json, "plan.json") == plan);
  json["parallel"]["replica_degree"] = 1;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].message,
            "1 does not equal world_size / (expert_parallel_degree / 2 folded ranks * hybrid_shard_degree * "
            "context_parallel_degree) = 2");
  json["parallel"]["context_exchange"] = "ring";
  const std::vector<Diagnostic> bad = plan_problems(json);
  ASSERT_FALSE(bad.empty());
  EXPECT_NE(bad[0].path.find("context_exchange"), std::string::npos) << describe(bad);
}

TEST(Plan, RoundTripsThroughAFile) {
  TempDir dir;
  const std::string path = dir.file("plan.json");
  write_file_atomic(path, plan_text());
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  EXPECT_EQ(bytes.str(), plan_text());
  EXPECT_EQ(bytes.str().back(), '\n');
  EXPECT_TRUE(read_plan_file(path) == searched_plan());
  // Writing again replaces the file and leaves no temporary behind.
  write_file_atomic(path, plan_text());
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.file("")), fs::directory_iterator()), 1);
}

TEST(Plan, ShippedProfilesRoundTripInsideThePlan) {
  const Plan& plan = searched_plan();
  // The sources of the hardware numbers travel with the plan.
  EXPECT_EQ(plan.cluster.sources.at("gpu.memory_bytes"),
            "NVIDIA A100 datasheet: 40 GB HBM2; nvidia-smi reports 40960 MiB");
  EXPECT_TRUE(plan.cluster.sources.contains("gpu.matmul_peak_efficiency"));
  const Json json = plan_json();
  EXPECT_EQ(json["cluster"]["gpu"]["memory_bytes"]["value"], 42949672960);
  EXPECT_EQ(json["parallel"]["replica_degree"], plan.parallel.replica_degree());
}

// One edit of a valid plan, and the one problem it must give.
struct PlanEdit {
  const char* name;
  const char* pointer;  // JSON pointer of the value to replace
  Json value;
  const char* path;
  const char* message;
};

std::vector<PlanEdit> plan_edits() {
  return {
      {"WorldSizeAsString", "/parallel/world_size", "sixteen", "parallel.world_size",
       "expected an integer, got string \"sixteen\""},
      {"StepTimeAsString", "/prediction/step_time_s", "fast", "prediction.step_time_s",
       "expected a number, got string \"fast\""},
      {"GlobalBatchAsFraction", "/training/global_batch_tokens", 2.5, "training.global_batch_tokens",
       "expected an integer, got number 2.5"},
      {"NegativeShardDegree", "/parallel/hybrid_shard_degree", -2, "parallel.hybrid_shard_degree",
       "must be in [0, 1048576], got -2"},
      {"ZeroWorldSize", "/parallel/world_size", 0, "parallel.world_size", "must be in [1, 1048576], got 0"},
      {"ZeroMicroBatch", "/parallel/micro_batch_size", 0, "parallel.micro_batch_size",
       "must be in [1, 65536], got 0"},
      {"NegativeAccumulation", "/parallel/gradient_accumulation_steps", -128,
       "parallel.gradient_accumulation_steps", "must be in [1, 65536], got -128"},
      {"ZeroTensorParallel", "/parallel/tensor_parallel_degree", 0, "parallel.tensor_parallel_degree",
       "must be in [1, 1048576], got 0"},
      {"NegativeExperts", "/model/num_experts", -8, "model.num_experts", "must be in [1, 4096], got -8"},
      {"WorldSize1e300", "/parallel/world_size", 1e300, "parallel.world_size",
       "must be in [1, 1048576], got 1e+300"},
      {"WorldSizeMaxUint64", "/parallel/world_size", Json(uint64_t{18446744073709551615u}), "parallel.world_size",
       "must be in [1, 1048576], got 18446744073709551615"},
      {"SeedMaxUint64", "/training/seed", Json(uint64_t{18446744073709551615u}), "training.seed",
       "must be in [0, 9223372036854775807], got 18446744073709551615"},
      {"StepTime1e300", "/prediction/step_time_s", 1e300, "prediction.step_time_s",
       "must be in [0, 1e+12], got 1e+300"},
      {"NegativeMfu", "/prediction/mfu", -0.5, "prediction.mfu", "must be in [0, 1], got -0.5"},
      {"DeviceBytesHuge", "/prediction/memory/device/activations", 1e300, "prediction.memory.device.activations",
       "must be in [0, 1152921504606846976], got 1e+300"},
      {"OffloadingAsString", "/parallel/activation_offloading", "yes", "parallel.activation_offloading",
       "expected true or false, got string \"yes\""},
      {"UnknownCheckpointing", "/parallel/activation_checkpointing", "partial", "parallel.activation_checkpointing",
       "expected one of \"none\", \"selective\", \"full\", \"attention_core\", \"latent_up\", got string \"partial\""},
      {"UnknownDispatcher", "/moe/dispatcher", "alltoallv", "moe.dispatcher",
       "expected one of \"alltoall\", \"allgather\", \"deepep\", got string \"alltoallv\""},
      {"PlacementRepeatsALetter", "/parallel/placement", "RRE", "parallel.placement",
       "expected the letters R, S and E once each and P and T at most once, outermost first (e.g. \"RSE\" or "
       "\"PRSET\"; \"D\" stands for \"RSE\"; or SMP's \"cluster\" or \"spread\"), got \"RRE\""},
      {"PlacementTooLong", "/parallel/placement", "RSEX", "parallel.placement",
       "expected the letters R, S and E once each and P and T at most once, outermost first (e.g. \"RSE\" or "
       "\"PRSET\"; \"D\" stands for \"RSE\"; or SMP's \"cluster\" or \"spread\"), got \"RSEX\""},
      {"PlacementLowerCase", "/parallel/placement", "rse", "parallel.placement",
       "expected the letters R, S and E once each and P and T at most once, outermost first (e.g. \"RSE\" or "
       "\"PRSET\"; \"D\" stands for \"RSE\"; or SMP's \"cluster\" or \"spread\"), got \"rse\""},
      {"PlacementAsNumber", "/parallel/placement", 3, "parallel.placement", "expected a string, got number 3"},
      {"SourcedBytesAsString", "/cluster/gpu/memory_bytes/value", "40GB", "cluster.gpu.memory_bytes",
       "expected an integer, got string \"40GB\""},
      {"SourceWithoutValue", "/cluster/framework/headroom_bytes", Json{{"source", "policy"}},
       "cluster.framework.headroom_bytes", "expected a value or {\"value\": ..., \"source\": \"...\"}"},
      {"NegativeLatency", "/cluster/intra_node/latency_s/value", -1, "cluster.intra_node.latency_s",
       "must be in [0, 1], got -1"},
      {"SchemaVersionTwo", "/schema_version", 2, "schema_version", "must be in [1, 1], got 2"},
      {"TrainingAsArray", "/training", Json::array(), "training", "expected an object, got an array"},
      {"ModelAsNull", "/model", nullptr, "model", "expected an object, got null"},
      {"AlternativeMfuOverOne", "/alternatives/0/mfu", 2, "alternatives[0].mfu", "must be in [0, 1], got 2"},
      {"AlternativesAsObject", "/alternatives", Json::object(), "alternatives",
       "expected an array of at most 1000 entries"},
      {"TimeItemAsString", "/prediction/time/compute", "long", "prediction.time.compute",
       "expected a number, got string \"long\""},
      {"DeviceItemsAsArray", "/prediction/memory/device", Json::array(), "prediction.memory.device",
       "expected an object of name: bytes, got an array"},
      {"SlidingWindowZero", "/model/sliding_window", 0, "model.sliding_window", "must be in [1, 16777216], got 0"},
      {"MatmulEfficiencyOverOne", "/cluster/gpu/matmul_peak_efficiency/value", 1.5,
       "cluster.gpu.matmul_peak_efficiency", "must be in [0.01, 1], got 1.5"},
      // Rules, checked once every field has been read, carry the rule name.
      {"ExpertsPerTokenOverExperts", "/model/experts_per_token", 9, "model.experts_per_token",
       "= 9 exceeds num_experts = 8 [top_k_within_experts]"},
      {"KvHeadsFive", "/model/num_key_value_heads", 5, "model.num_key_value_heads",
       "= 5 does not divide num_attention_heads = 32 [kv_heads_divide_heads]"},
      {"WarmupPastSteps", "/training/warmup_steps", 1000, "training.warmup_steps",
       "= 1000 exceeds steps = 100 [warmup_within_steps]"},
      {"SwappedPeaks", "/cluster/gpu/peak_fp32_flops/value", 1e15, "cluster.gpu.peak_fp32_flops",
       "exceeds gpu.peak_bf16_flops; the two are probably swapped"},
  };
}

class PlanEditTest : public testing::TestWithParam<PlanEdit> {};

TEST_P(PlanEditTest, ReportsTheFieldPath) {
  const PlanEdit& edit = GetParam();
  Json json = plan_json();
  const Json::json_pointer pointer(edit.pointer);
  ASSERT_TRUE(json.contains(pointer)) << edit.pointer;
  json[pointer] = edit.value;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_FALSE(problems.empty());
  EXPECT_EQ(problems[0].path, edit.path) << describe(problems);
  EXPECT_EQ(problems[0].message, edit.message) << describe(problems);
  if (std::string(edit.name) != "ExpertsPerTokenOverExperts") {  // also empties the imbalance range
    EXPECT_EQ(problems.size(), 1u) << describe(problems);
  }
}

INSTANTIATE_TEST_SUITE_P(Plan, PlanEditTest, testing::ValuesIn(plan_edits()),
                         [](const testing::TestParamInfo<PlanEdit>& param) { return std::string(param.param.name); });

TEST(Plan, ExpertDegreeThreeBreaksThreeRules) {
  Json json = plan_json();
  json["parallel"]["expert_parallel_degree"] = 3;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_EQ(problems.size(), 3u) << describe(problems);
  EXPECT_EQ(problems[0].path, "parallel.expert_parallel_degree");
  EXPECT_EQ(problems[0].message, "= 3 does not divide num_experts = 8 [expert_degree_divides_experts]");
  EXPECT_EQ(problems[1].path, "parallel.expert_parallel_degree");
  EXPECT_EQ(problems[1].message, "= 3 does not divide world_size = 16 [expert_degree_divides_world]");
  EXPECT_EQ(problems[2].path, "parallel.hybrid_shard_degree");
}

TEST(Plan, ReplicaDegreeMustAgree) {
  const Plan& plan = searched_plan();
  const int64_t replicas = plan.parallel.replica_degree();
  Json json = plan_json();
  json["parallel"]["replica_degree"] = replicas + 1;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "parallel.replica_degree");
  std::string degrees = "expert_parallel_degree * hybrid_shard_degree";
  if (plan.parallel.tensor_parallel_degree != 1) degrees += " * tensor_parallel_degree";
  if (plan.parallel.pipeline_parallel_degree != 1) degrees += " * pipeline_parallel_degree";
  EXPECT_EQ(problems[0].message,
            std::to_string(replicas + 1) + " does not equal world_size / (" + degrees + ") = " + std::to_string(replicas));
  // replica_degree is derived, so leaving it out is fine.
  json["parallel"].erase("replica_degree");
  EXPECT_TRUE(plan_from_json(json, "plan.json") == plan);
}

TEST(Plan, DeviceItemsMustAddUpToTheirTotal) {
  const MemoryBreakdown& memory = searched_plan().prediction.memory;
  Json json = plan_json();
  json["prediction"]["memory"]["device"]["activations"] = json["prediction"]["memory"]["device"]["activations"].get<int64_t>() + 1;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "prediction.memory.device_total_bytes");
  EXPECT_EQ(problems[0].message, "= " + std::to_string(memory.device_total_bytes) +
                                     " does not equal the sum of the device items = " +
                                     std::to_string(memory.device_total_bytes + 1));
}

TEST(Plan, HostItemsMustAddUpToTheirTotal) {
  const MemoryBreakdown& memory = searched_plan().prediction.memory;
  Json json = plan_json();
  json["prediction"]["memory"]["host_total_bytes"] = memory.host_total_bytes + 4096;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "prediction.memory.host_total_bytes");
  EXPECT_EQ(problems[0].message, "= " + std::to_string(memory.host_total_bytes + 4096) +
                                     " does not equal the sum of the host items = " +
                                     std::to_string(memory.host_total_bytes));
}

TEST(Plan, AnExtraDeviceItemMustBeCountedInTheTotal) {
  Json json = plan_json();
  json["prediction"]["memory"]["device"]["nccl_buffers"] = 1024;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "prediction.memory.device_total_bytes");
}

TEST(Plan, UnknownFieldsAtEveryLevel) {
  const std::vector<std::pair<std::string, std::string>> additions = {
      {"/comment", "comment"},
      {"/parallel/expert_paralel_degree", "parallel.expert_paralel_degree"},
      {"/cluster/gpu/memory_byte", "cluster.gpu.memory_byte"},
      {"/cluster/gpu/matmul_tiles", "cluster.gpu.matmul_tiles"},
      {"/model/num_expert", "model.num_expert"},
      {"/moe/capacity", "moe.capacity"},
      {"/training/lr", "training.lr"},
      {"/prediction/memory/device_peak_bytes", "prediction.memory.device_peak_bytes"},
      {"/prediction/estimate", "prediction.estimate"},
      {"/alternatives/1/parallel/exprt_parallel_degree", "alternatives[1].parallel.exprt_parallel_degree"},
      {"/alternatives/0/note", "alternatives[0].note"},
      {"/provenance/user", "provenance.user"},
  };
  for (const auto& [pointer, path] : additions) {
    Json json = plan_json();
    json[Json::json_pointer(pointer)] = 1;
    const std::vector<Diagnostic> problems = plan_problems(json);
    ASSERT_EQ(problems.size(), 1u) << pointer << describe(problems);
    EXPECT_EQ(problems[0].path, path);
    EXPECT_EQ(problems[0].message, "unknown field");
  }
}

TEST(Plan, MisspeltFieldIsUnknownAndTheRealOneMissing) {
  Json json = plan_json();
  Json& parallel = json["parallel"];
  parallel["gradient_accumulation_step"] = parallel["gradient_accumulation_steps"];
  parallel.erase("gradient_accumulation_steps");
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_EQ(problems.size(), 2u) << describe(problems);
  EXPECT_EQ(problems[0].path, "parallel.gradient_accumulation_steps");
  EXPECT_EQ(problems[0].message, "missing required field");
  EXPECT_EQ(problems[1].path, "parallel.gradient_accumulation_step");
  EXPECT_EQ(problems[1].message, "unknown field");
}

TEST(Plan, MissingFields) {
  const std::vector<std::pair<std::string, std::string>> removals = {
      {"/training/seq_len", "training.seq_len"},
      {"/prediction", "prediction"},
      {"/cluster/gpu/peak_bf16_flops", "cluster.gpu.peak_bf16_flops"},
      {"/model/name", "model.name"},
      {"/prediction/memory/device_limit_bytes", "prediction.memory.device_limit_bytes"},
      {"/alternatives/0/device_peak_bytes", "alternatives[0].device_peak_bytes"},
  };
  for (const auto& [pointer, path] : removals) {
    Json json = plan_json();
    const Json::json_pointer at(pointer);
    json[at.parent_pointer()].erase(at.back());
    const std::vector<Diagnostic> problems = plan_problems(json);
    ASSERT_FALSE(problems.empty()) << pointer;
    EXPECT_EQ(problems[0].path, path) << describe(problems);
    EXPECT_EQ(problems[0].message, "missing required field");
  }
  // Optional parts may go. (Without tensor and pipeline parallelism every rank reads data: the
  // same batch takes T x P times fewer micro-batches per rank.)
  Json json = plan_json();
  json.erase("alternatives");
  json.erase("provenance");
  Json& parallel = json["parallel"];
  const int64_t tp = parallel["tensor_parallel_degree"].get<int64_t>() * parallel["pipeline_parallel_degree"].get<int64_t>();
  parallel["gradient_accumulation_steps"] = parallel["gradient_accumulation_steps"].get<int64_t>() / tp;
  for (const char* field : {"tensor_parallel_degree", "pipeline_parallel_degree", "sequence_parallel", "replica_degree"})
    parallel.erase(field);
  json["moe"].erase("random_seed");
  const Plan plan = plan_from_json(json, "plan.json");
  EXPECT_TRUE(plan.alternatives.empty());
  EXPECT_EQ(plan.parallel.tensor_parallel_degree, 1);
  EXPECT_EQ(plan.parallel.pipeline_parallel_degree, 1);
  EXPECT_FALSE(plan.parallel.sequence_parallel);
  EXPECT_EQ(plan.moe.random_seed, 12345);
}

TEST(Plan, EveryProblemIsReportedInReadingOrder) {
  Json json = plan_json();
  json["parallel"]["world_size"] = "x";
  json["parallel"]["placement"] = "XYZ";
  json["moe"]["foo"] = true;
  json["training"]["seed"] = -1;
  json["prediction"]["mfu"] = 2;
  json["alternatives"][0]["parallel"]["micro_batch_size"] = 0;
  try {
    plan_from_json(json, "plan.json");
    FAIL() << "accepted";
  } catch (const InputError& e) {
    const std::vector<std::string> paths = {"parallel.world_size",  "parallel.placement",
                                            "moe.foo",              "training.seed",
                                            "prediction.mfu",       "alternatives[0].parallel.micro_batch_size"};
    ASSERT_EQ(e.diagnostics().size(), paths.size()) << describe(e.diagnostics());
    for (size_t i = 0; i < paths.size(); ++i) EXPECT_EQ(e.diagnostics()[i].path, paths[i]) << i;
    EXPECT_STREQ(e.what(), "plan.json: parallel.world_size: expected an integer, got string \"x\" (and 5 more)");
    const std::vector<std::string> lines = e.lines();
    ASSERT_EQ(lines.size(), paths.size());
    EXPECT_EQ(lines[3], "plan.json: training.seed: must be in [0, 9223372036854775807], got -1");
  }
}

TEST(Plan, TruncatedFileIsNotValidJson) {
  TempDir dir;
  // Cut inside the "parallel" object.
  const size_t cut = plan_text().find("\"hybrid_shard_degree\"");
  ASSERT_NE(cut, std::string::npos);
  const std::string path = dir.write("plan.json", plan_text().substr(0, cut + 10));
  const std::vector<Diagnostic> problems = plan_file_problems(path);
  ASSERT_EQ(problems.size(), 1u) << describe(problems);
  EXPECT_EQ(problems[0].path, "");
  EXPECT_EQ(problems[0].message.rfind("not valid JSON (parse error at line ", 0), 0u) << problems[0].message;
}

TEST(Plan, EmptyFileIsNotValidJson) {
  TempDir dir;
  const std::vector<Diagnostic> problems = plan_file_problems(dir.write("plan.json", ""));
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "");
  EXPECT_EQ(problems[0].message.rfind("not valid JSON (", 0), 0u) << problems[0].message;
}

TEST(Plan, MissingFileNamesTheFile) {
  TempDir dir;
  const std::string path = dir.file("absent.json");
  const std::vector<Diagnostic> problems = plan_file_problems(path);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "");
  EXPECT_EQ(problems[0].message, "cannot open file");
}

TEST(Plan, WrongDocumentTypes) {
  for (const char* text : {"[]", "null", "42", "\"plan\""}) {
    const std::vector<Diagnostic> problems = plan_problems(parse_json_text(text, "plan.json"));
    ASSERT_EQ(problems.size(), 1u) << text;
    EXPECT_EQ(problems[0].path, "") << text;
    EXPECT_EQ(problems[0].message.rfind("expected an object, got ", 0), 0u) << problems[0].message;
  }
}

TEST(Plan, HugeNumberTextsFromAFile) {
  TempDir dir;
  // Each replaces the world_size value in the text, as a hand edit would.
  const std::string key = "\"world_size\": 16";
  const size_t at = plan_text().find(key);
  ASSERT_NE(at, std::string::npos);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"1e300", "must be in [1, 1048576], got 1e+300"},
      {"18446744073709551615", "must be in [1, 1048576], got 18446744073709551615"},
      // Below INT64_MIN the parser makes it a double.
      {"-9223372036854775809", "must be in [1, 1048576], got -9.223372036854776e+18"},
      {"16.5", "expected an integer, got number 16.5"},
  };
  for (const auto& [number, message] : cases) {
    std::string text = plan_text();
    text.replace(at, key.size(), "\"world_size\": " + number);
    const std::vector<Diagnostic> problems = plan_file_problems(dir.write("plan.json", text));
    ASSERT_EQ(problems.size(), 1u) << number << describe(problems);
    EXPECT_EQ(problems[0].path, "parallel.world_size") << number;
    EXPECT_EQ(problems[0].message, message) << number;
  }
}

// A number beyond a double (1e400) in a plan file is an InputError naming the file.
TEST(Plan, NumberTooLargeForADoubleIsAnInputError) {
  TempDir dir;
  std::string text = plan_text();
  const std::string key = "\"world_size\": 16";
  text.replace(text.find(key), key.size(), "\"world_size\": 1e400");
  const std::string path = dir.write("plan.json", text);
  try {
    read_plan_file(path);
    FAIL() << "accepted 1e400";
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), path);
    ASSERT_FALSE(e.diagnostics().empty());
  } catch (const std::exception& e) {
    FAIL() << "threw a non-InputError: " << e.what();
  }
}

// 2^63 as a float equals static_cast<double>(INT64_MAX) but does not fit in int64: it must be
// out of range, not read as INT64_MIN.
TEST(Plan, SeedOfTwoToThe63AsFloatIsOutOfRange) {
  for (const char* pointer : {"/moe/random_seed", "/training/seed"}) {
    Json json = plan_json();
    json[Json::json_pointer(pointer)] = 9223372036854775808.0;
    try {
      const Plan plan = plan_from_json(json, "plan.json");
      ADD_FAILURE() << pointer << " accepted, read as moe.random_seed = " << plan.moe.random_seed
                    << ", training.seed = " << plan.training.seed;
    } catch (const InputError& e) {
      ASSERT_EQ(e.diagnostics().size(), 1u) << describe(e.diagnostics());
      EXPECT_EQ(e.diagnostics()[0].message.rfind("must be in [0, 9223372036854775807], got ", 0), 0u)
          << e.diagnostics()[0].message;
    }
  }
}

// Items whose int64 sum would wrap (16 x 2^60 = 2^64) cannot add up to any total, 0 included.
TEST(Plan, DeviceItemsThatOverflowDoNotAddUpToZero) {
  Json json = plan_json();
  Json device = Json::object();
  for (int i = 0; i < 16; ++i) device["item" + std::to_string(i)] = int64_t{1} << 60;
  json["prediction"]["memory"]["device"] = device;
  json["prediction"]["memory"]["device_total_bytes"] = 0;
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_FALSE(problems.empty());
  EXPECT_EQ(problems[0].path, "prediction.memory.device_total_bytes") << describe(problems);
}

// Alternatives are the same run with another parallel configuration and obey the same rules.
TEST(Plan, AlternativesAreCheckedByTheRules) {
  Json json = plan_json();
  ASSERT_FALSE(json["alternatives"].empty());
  Json& parallel = json["alternatives"][0]["parallel"];
  parallel["world_size"] = 12;
  parallel["expert_parallel_degree"] = 3;
  parallel["hybrid_shard_degree"] = 0;
  parallel.erase("replica_degree");
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_FALSE(problems.empty());
  EXPECT_EQ(problems[0].path.rfind("alternatives[0].parallel.", 0), 0u) << describe(problems);
}

// A degree that fails to read is reported once: the derived replica_degree is not checked
// against its fallback value.
TEST(Plan, BadExpertDegreeIsReportedOnce) {
  for (const Json& value : {Json("two"), Json(0)}) {
    Json json = plan_json();
    json["parallel"]["expert_parallel_degree"] = value;
    const std::vector<Diagnostic> problems = plan_problems(json);
    ASSERT_FALSE(problems.empty());
    EXPECT_EQ(problems[0].path, "parallel.expert_parallel_degree");
    EXPECT_EQ(problems.size(), 1u) << value.dump() << describe(problems);
  }
  Json json = plan_json();
  Json& parallel = json["parallel"];
  parallel["expert_paralel_degree"] = parallel["expert_parallel_degree"];
  parallel.erase("expert_parallel_degree");
  const std::vector<Diagnostic> problems = plan_problems(json);
  ASSERT_FALSE(problems.empty());
  EXPECT_EQ(problems[0].path, "parallel.expert_parallel_degree");
  EXPECT_EQ(problems[0].message, "missing required field");
  ASSERT_EQ(problems.size(), 2u) << describe(problems);
  EXPECT_EQ(problems[1].path, "parallel.expert_paralel_degree");
  EXPECT_EQ(problems[1].message, "unknown field");
}

// Every rule accepts this model (2^24 heads of 2^17, hidden 1, 100 layers, seq_len 2^24, no
// checkpointing), and its activations are beyond any device: the estimate saturates and is
// never negative.
TEST(Plan, MemoryEstimateOfAnAcceptedPlanIsNotNegative) {
  Json json = plan_json();
  json["alternatives"] = Json::array();  // their micro-batches would break micro_batch_tokens
  Json& model = json["model"];
  model["hidden_size"] = 1;
  model["num_attention_heads"] = 16777216;
  model["num_key_value_heads"] = 1;
  model["head_dim"] = 131072;
  model["num_layers"] = 100;
  model["max_position_embeddings"] = 16777216;
  json["training"]["seq_len"] = 16777216;
  json["training"]["global_batch_tokens"] = int64_t{16} * 16777216;
  Json& parallel = json["parallel"];
  parallel["micro_batch_size"] = 1;
  parallel["gradient_accumulation_steps"] = 1;
  parallel["activation_checkpointing"] = "none";
  parallel["activation_offloading"] = false;
  const Plan plan = plan_from_json(json, "plan.json");  // valid by every rule
  const planner::MemoryEstimate memory =
      planner::estimate_memory({plan.model, plan.cluster, plan.parallel, plan.moe, plan.training});
  EXPECT_GE(memory.activations, 0);
  EXPECT_GE(memory.device_total, 0);
  EXPECT_GT(memory.device_total, plan.cluster.usable_memory_bytes());
}

}  // namespace
}  // namespace moeplan

namespace moeplan {
namespace {

// Token dropping reads back as written, and a dropless plan writes none of its fields.
TEST(Plan, CapacityFactorRoundTrips) {
  MoeConfig moe;
  EXPECT_FALSE(to_json(moe).contains("capacity_factor"));
  EXPECT_FALSE(to_json(moe).contains("drop_policy"));
  moe.capacity_factor = 1.25;
  moe.drop_policy = TokenDropPolicy::kPosition;
  moe.pad_to_capacity = true;
  const Json j = to_json(moe);
  EXPECT_EQ(j.at("capacity_factor"), 1.25);
  EXPECT_EQ(j.at("drop_policy"), "position");
  Diagnostics d;
  EXPECT_EQ(read_moe(j, "moe", d), moe);
  EXPECT_TRUE(d.empty());
  Json bad = j;
  bad["drop_policy"] = "random";
  read_moe(bad, "moe", d);
  ASSERT_FALSE(d.empty());
  EXPECT_EQ(d.items().front().path, "moe.drop_policy");
}

}  // namespace
}  // namespace moeplan
