#include "moeplan/validation/matrix.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <stdexcept>

#include "moeplan/core/process.h"

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
                c.checkpointing.c_str(), c.offload ? "-offload" : "", static_cast<long long>(c.mbs));
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
    const char* ckpt;
    bool offload;
    int64_t mbs;
  };
  const std::vector<Variant> variants{{"none", false, 1}, {"none", false, 4},     {"full", false, 2},
                                      {"selective", true, 2}, {"selective", false, 4}, {"full", true, 2}};
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
  // where the blocks divide into its stages.
  const bool splits = model.num_attention_heads % ranks == 0 && model.num_key_value_heads % ranks == 0 &&
                      model.intermediate_size % ranks == 0 && model.vocab_size % ranks == 0 && seq_len % ranks == 0;
  const std::vector<Variant> tensor_variants{{"none", false, 4}, {"full", false, 2}};
  const std::vector<Variant> pipeline_variants{{"none", false, 2}, {"selective", false, 4}};
  for (size_t i = 0; i < (quick ? 1u : 2u); ++i) {
    for (const bool tensor : {true, false}) {
      if (tensor ? !splits : model.num_layers % ranks != 0) continue;
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
                                setting.precision,
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
                                c.checkpointing,
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

}  // namespace moeplan::validation
