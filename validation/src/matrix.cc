#include "moeplan/validation/matrix.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <stdexcept>

#include "moeplan/core/errors.h"
#include "moeplan/core/process.h"
#include "moeplan/planner/request.h"

namespace moeplan::validation {

std::string self_path() {
  const std::optional<std::string> self = this_program_path();
  if (!self) throw std::runtime_error("cannot find this program (/proc/self/exe)");
  return *self;
}

// Runs argv with its output into log; the exit code (or 128 + signal).
int run_logged(const std::vector<std::string>& argv, const std::string& log) {
  ChildProgram child;
  child.path = argv[0];
  child.argv = argv;
  child.output_path = log;
  const pid_t pid = start_child(child);
  if (pid < 0) return 127;
  const ChildExit ended = wait_for_child(pid);
  return ended.exited ? ended.code : 128 + ended.signal;
}

std::string last_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

namespace {

std::string config_name(const MatrixConfig& c, int64_t ranks) {
  const std::string split = c.t > 1 ? "T" + std::to_string(c.t) : c.p > 1 ? "P" + std::to_string(c.p) : "";
  char name[96];
  std::snprintf(name, sizeof name, "E%lldS%lldR%lld%s-%s%s-mbs%lld", static_cast<long long>(c.e),
                static_cast<long long>(c.s), static_cast<long long>(ranks / (c.e * c.s * c.t * c.p)), split.c_str(),
                std::string(name_of(kCheckpointingNames, c.checkpointing)).c_str(), c.offload ? "-offload" : "",
                static_cast<long long>(c.mbs));
  return name;
}

}  // namespace

std::vector<MatrixConfig> validation_matrix(int64_t ranks, const ModelSpec& model, int64_t seq_len, bool quick) {
  std::vector<std::pair<int64_t, int64_t>> layouts;  // (E, S)
  layouts.emplace_back(1, 1);
  if (ranks > 1 && model.num_experts % ranks == 0) layouts.emplace_back(ranks, 1);
  if (ranks > 1) layouts.emplace_back(1, ranks);
  if (ranks >= 4 && model.num_experts % 2 == 0) layouts.emplace_back(2, ranks / 2);
  struct Variant {
    Checkpointing ckpt;
    bool offload;
    int64_t mbs;
  };
  constexpr Checkpointing kNone = Checkpointing::kNone, kFull = Checkpointing::kFull,
                          kSelective = Checkpointing::kSelective;
  const std::vector<Variant> variants{{kNone, false, 1},     {kNone, false, 4},      {kFull, false, 2},
                                      {kSelective, true, 2}, {kSelective, false, 4}, {kFull, true, 2}};
  // A configuration of degrees (E, S, T, P) with a variant's checkpointing, offload and micro-batch.
  auto config = [&](int64_t e, int64_t s, int64_t t, int64_t p, const Variant& v) {
    MatrixConfig c;
    c.e = e;
    c.s = s;
    c.t = t;
    c.p = p;
    c.mbs = v.mbs;
    c.checkpointing = v.ckpt;
    c.offload = v.offload;
    c.name = config_name(c, ranks);
    return c;
  };
  std::vector<MatrixConfig> out;
  const size_t count = quick ? 4 : 10;
  for (size_t i = 0; out.size() < count && i < layouts.size() * variants.size(); ++i) {
    const auto& [e, s] = layouts[i % layouts.size()];
    const MatrixConfig c = config(e, s, 1, 1, variants[(i + i / layouts.size()) % variants.size()]);
    if (std::none_of(out.begin(), out.end(), [&](const MatrixConfig& o) { return o.name == c.name; })) out.push_back(c);
  }
  if (ranks < 2) return out;
  // Every rank in one tensor split (sequence parallel, as the executor runs it) where the
  // heads, key-value heads, expert width, vocabulary and sequence divide, and in one pipeline
  // where the blocks divide into its stages (and the model has no multi-token prediction: such
  // a model, DeepSeek's, is planned here with the balance loss, which the executor does not train
  // through pipeline stages: rule executor_pipeline_limits).
  const bool splits = model.num_attention_heads % ranks == 0 && model.num_key_value_heads % ranks == 0 &&
                      model.intermediate_size % ranks == 0 && model.vocab_size % ranks == 0 && seq_len % ranks == 0;
  const std::vector<Variant> tensor_variants{{kNone, false, 4}, {kFull, false, 2}};
  const std::vector<Variant> pipeline_variants{{kNone, false, 2}, {kSelective, false, 4}};
  for (size_t i = 0; i < (quick ? 1u : 2u); ++i) {
    for (const bool tensor : {true, false}) {
      if (tensor ? !splits : model.num_layers % ranks != 0 || model.mtp_layers > 0) continue;
      out.push_back(tensor ? config(1, 1, ranks, 1, tensor_variants[i]) : config(1, 1, 1, ranks, pipeline_variants[i]));
    }
  }
  return out;
}

std::vector<std::string> pinned_search(const std::string& self, const MatrixSetting& setting, const MatrixConfig& c,
                                       const std::string& profile, const std::string& plan) {
  std::vector<std::string> argv{self,
                                "search",
                                "--gpus",
                                std::to_string(setting.ranks),
                                "--instance",
                                profile,
                                "--model",
                                setting.model,
                                "--seq-len",
                                std::to_string(setting.seq_len),
                                "--global-batch-tokens",
                                std::to_string(setting.global_batch_tokens),
                                "--precision",
                                std::string(name_of(kPrecisionNames, setting.precision)),
                                "--max-micro-batch",
                                "64",
                                "--expert-parallel-degree",
                                std::to_string(c.e),
                                "--hybrid-shard-degree",
                                std::to_string(c.s),
                                "--tensor-parallel-degree",
                                std::to_string(c.t),
                                "--pipeline-parallel-degree",
                                std::to_string(c.p),
                                "--checkpointing",
                                std::string(name_of(kCheckpointingNames, c.checkpointing)),
                                "--offload",
                                c.offload ? "on" : "off",
                                "--micro-batch",
                                std::to_string(c.mbs),
                                "--target", "moeplan",
                                "--out",
                                plan};
  if (!setting.profiles.empty()) argv.insert(argv.end(), {"--profiles", setting.profiles});
  return argv;
}

Plan pinned_plan(const MatrixSetting& setting, const MatrixConfig& c, const std::string& profile,
                 const std::string& path) {
  planner::SearchRequest r;
  r.instance = profile;
  r.model = setting.model;
  r.profiles = setting.profiles;
  r.gpus = std::to_string(setting.ranks);
  r.options.training.seq_len = setting.seq_len;
  r.options.training.global_batch_tokens = setting.global_batch_tokens;
  r.precision = setting.precision;
  r.options.max_micro_batch = 64;
  r.options.target = planner::executor_target();
  planner::SearchOptions::Pins& pin = r.options.pins;
  pin.expert_parallel_degree = c.e;
  pin.hybrid_shard_degree = c.s;
  pin.tensor_parallel_degree = c.t;
  pin.pipeline_parallel_degree = c.p;
  pin.checkpointing = c.checkpointing;
  pin.offloading = c.offload;
  pin.micro_batch_size = c.mbs;
  std::string command = "moeplan";
  const std::vector<std::string> words = pinned_search(command, setting, c, profile, path);
  for (size_t i = 1; i < words.size(); ++i) command += " " + words[i];
  try {
    const planner::SearchOutcome found = planner::plan_search(r, command);
    if (!found.plan) throw std::runtime_error(c.name + ": search found no plan: " + planner::stats_text(found.result.stats));
    write_file_atomic(path, plan_to_text(*found.plan));
    return *found.plan;
  } catch (const InputError& e) {
    throw std::runtime_error(c.name + ": search found no plan: moeplan: error: " + e.lines().back());
  }
}

}  // namespace moeplan::validation
