// Helpers for tests that train through the real moeplan binary on real text: a small corpus
// from Debian's fortunes package, a tokenizer trained on it, and a one-rank plan.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"
#include "moeplan/executor/io/tensor_file.h"
#include "moeplan/executor/training/trainer.h"
#include "test_support.h"

namespace moeplan::test {

inline constexpr char kFortunesDir[] = "/usr/share/games/fortunes";

struct Command {
  int exit_code = -1;
  std::string out, err;
  std::string all() const { return out + err; }
};

// Runs a shell command with stdout and stderr captured apart.
inline Command run_command(const std::string& command) {
  const TempDir tmp;
  const std::string err_path = tmp.file("stderr");
  Command r;
  FILE* pipe = ::popen((command + " 2>" + err_path).c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buffer{};
  size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) r.out.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = read_text(err_path);
  return r;
}

// Runs `moeplan args` with stdout and stderr captured apart, so a test can tell that error
// lines went to stderr.
// The moeplan binary the tests run: this build's, or MOEPLAN_TEST_BINARY's (a test program run on
// another machine beside its own build's binary, bench/gpu/gpu_ranks.sh).
inline std::string moeplan_binary() {
  const char* other = std::getenv("MOEPLAN_TEST_BINARY");
  return other != nullptr && *other != '\0' ? other : MOEPLAN_BINARY;
}

inline Command run_moeplan(const std::string& args) { return run_command(moeplan_binary() + " " + args); }

// Starts `moeplan args...` in the background, with `env` ("NAME=value") added to the
// environment and stdout and stderr written to the given files; returns the child's pid.
// `wrapper` runs before the binary (e.g. {"ip", "netns", "exec", "h1"}).
inline pid_t spawn_moeplan(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                           const std::string& out = "/dev/null", const std::string& err = "/dev/null",
                           const std::vector<std::string>& wrapper = {}) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<std::string> storage = wrapper;
    storage.push_back(moeplan_binary());
    storage.insert(storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& s : storage) argv.push_back(s.data());
    argv.push_back(nullptr);
    for (const std::string& e : env) ::putenv(const_cast<char*>(e.c_str()));
    if (!std::freopen(out.c_str(), "w", stdout) || !std::freopen(err.c_str(), "w", stderr)) ::_exit(126);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Waits for a spawned child at most `seconds`: its exit code, -1 if a signal ended it, or -2 if
// it was still running (it is killed then).
inline int wait_moeplan(pid_t pid, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -2;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// For failure messages.
inline std::string show(const Command& c) {
  return "exit " + std::to_string(c.exit_code) + "\n--- stdout\n" + c.out + "--- stderr\n" + c.err;
}

// Fortune files of real English text (the package `fortunes`); empty if it is not installed.
inline std::vector<std::string> fortune_files(const std::vector<std::string>& names) {
  std::vector<std::string> files;
  for (const std::string& name : names) {
    const std::string path = (std::filesystem::path(kFortunesDir) / name).string();
    if (!std::filesystem::exists(path)) return {};
    files.push_back(path);
  }
  return files;
}

// A shipped tiny model (mixtral-tiny, qwen3-tiny) with a smaller vocabulary, written into dir
// (model.json for mixtral-tiny, <profile>.json for the others); returns the model file.
inline std::string write_small_model(const TempDir& dir, int64_t vocab_size,
                                     const std::string& profile = "mixtral-tiny") {
  Json model = read_json_file(profile_path("models/" + profile + ".json"));
  model["name"] = profile + "-v" + std::to_string(vocab_size);
  model["vocab_size"] = vocab_size;
  return dir.write(profile == "mixtral-tiny" ? "model.json" : profile + ".json", model);
}

// A one-rank plan for the local CPU profile.
inline Command make_plan(const std::string& model_file, const std::string& out, int64_t seq_len,
                               int64_t global_batch_tokens, const std::string& precision, int64_t max_micro_batch) {
  return run_moeplan(("search --gpus 1 --instance local-cpu --model " + model_file + " --seq-len " +
                                     std::to_string(seq_len) + " --global-batch-tokens " +
                                     std::to_string(global_batch_tokens) + " --precision " + precision +
                                     " --max-micro-batch " + std::to_string(max_micro_batch) + " --out " + out));
}

inline Command prepare_data(const std::vector<std::string>& inputs, const std::string& out, int64_t vocab_size,
                                  int64_t block_size) {
  std::string files;
  for (const std::string& f : inputs) files += " " + f;
  return run_moeplan(("data prepare --input" + files + " --out " + out + " --vocab-size " +
                                     std::to_string(vocab_size) + " --block-size " + std::to_string(block_size) +
                                     " --document-separator %"));
}

// What the 4-rank fault and stop tests train: the fortunes text prepared into `dir`/data (a
// 512-piece vocabulary, 64-token blocks), mixtral-tiny's one-rank plan (plan-1.json) and the
// same plan on 4 ranks, E2 S2 R1, one micro-batch a step (plan-4.json, `edit` applied last).
// Both paths stay empty when the fortunes package is missing; a failure fails the caller.
struct FourRankPlans {
  std::string one_rank, four_ranks;
};
inline void write_four_rank_plans(const TempDir& dir, FourRankPlans& out,
                                  const std::function<void(Json&)>& edit = nullptr) {
  const auto files = fortune_files({"fortunes", "wisdom", "science", "computers"});
  if (files.empty()) return;
  const Command r = prepare_data(files, dir.file("data"), 512, 64);
  ASSERT_EQ(r.exit_code, 0) << show(r);
  const std::string model = write_small_model(dir, 512);
  const std::string one_rank = dir.file("plan-1.json");
  const Command made = make_plan(model, one_rank, 64, 256, "fp32", 1);
  ASSERT_EQ(made.exit_code, 0) << show(made);
  Json plan = read_json_file(one_rank);
  Json& p = plan["parallel"];
  p["world_size"] = 4;
  p["expert_parallel_degree"] = 2;
  p["hybrid_shard_degree"] = 2;
  p["replica_degree"] = 1;
  p["micro_batch_size"] = 1;
  p["gradient_accumulation_steps"] = 1;
  plan["cluster"]["num_nodes"] = 2;
  plan["alternatives"] = Json::array();
  if (edit) edit(plan);
  out.four_ranks = dir.write("plan-4.json", plan);
  out.one_rank = one_rank;
}

// The processes of rank `rank` among `launcher`'s children: named "moeplan r<rank>" (a copy of
// the launcher) or started with MOEPLAN_RANK=<rank> in their environment.
inline std::vector<pid_t> rank_processes(pid_t launcher, int64_t rank) {
  const std::string name = "moeplan r" + std::to_string(rank), entry = "MOEPLAN_RANK=" + std::to_string(rank);
  std::vector<pid_t> found;
  for (const auto& p : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = p.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(p.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto open = line.find('('), close = line.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close < open) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != launcher) continue;
    bool match = line.substr(open + 1, close - open - 1) == name;
    std::ifstream environ(p.path() / "environ", std::ios::binary);
    for (std::string var; !match && std::getline(environ, var, '\0');) match = var == entry;
    if (match) found.push_back(static_cast<pid_t>(std::stoi(pid)));
  }
  return found;
}

using executor::read_metrics;  // the metrics.jsonl lines of a run, parsed

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// mixtral-tiny for trainers driven in-process: 64-token sequences, micro-batches of 2, two a
// step, 10 steps without warmup, the auxiliary balancing loss.
inline Plan tiny_plan(Precision precision) {
  Plan plan;
  plan.model = model("mixtral-tiny");
  plan.training.seq_len = 64;
  plan.training.precision = precision;
  plan.training.steps = 10;
  plan.training.warmup_steps = 0;
  plan.parallel.micro_batch_size = 2;
  plan.parallel.gradient_accumulation_steps = 2;
  plan.moe.load_balancing = LoadBalancing::kAuxLoss;
  return plan;
}

// Sets the first element of every slice of `name` in a checkpoint to NaN and mends the manifest
// (size and checksum): a checkpoint that is whole but holds a bad weight, as one saved after a
// NaN crept into the weights would be. Returns how many slices were changed.
inline int plant_nan(const std::string& step_dir, const std::string& name) {
  Json manifest = read_json_file(step_dir + "/manifest.json");
  int planted = 0;
  for (Json& f : manifest["files"]) {
    const std::string path = step_dir + "/" + f["name"].get<std::string>();
    executor::TensorFile file = executor::read_tensor_file(path);
    bool changed = false;
    for (auto& [key, t] : file.tensors)
      if (key.rfind("param/" + name + "@", 0) == 0) {
        t.view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
        changed = true;
        ++planted;
      }
    if (!changed) continue;
    f["crc32"] = executor::write_tensor_file(path, file.tensors, file.metadata);
    f["bytes"] = static_cast<int64_t>(std::filesystem::file_size(path));
  }
  write_file_atomic(step_dir + "/manifest.json", manifest.dump(2));
  return planted;
}

// Replaces the file at `path` with `bytes`.
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// The lines of the InputError `f` throws; a test failure (and "") if it throws nothing or
// something else.
template <class F>
std::string input_error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    std::string text;
    for (const std::string& line : e.lines()) text += line + "\n";
    return text;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an InputError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no error";
  return "";
}

}  // namespace moeplan::test
