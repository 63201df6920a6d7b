// Helpers for tests that train through the real moeplan binary on real text: a small corpus
// from Debian's fortunes package, a tokenizer trained on it, and a one-rank plan.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "test_support.h"

namespace moeplan::test {

inline constexpr char kFortunesDir[] = "/usr/share/games/fortunes";

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buffer{};
  size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) r.output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string moeplan_command(const std::string& args) { return std::string(MOEPLAN_BINARY) + " " + args; }

// Fortune files of real English text (the package `fortunes`); empty if it is not installed.
inline std::vector<std::string> fortune_files(const std::vector<std::string>& names) {
  std::vector<std::string> files;
  for (const std::string& name : names) {
    const std::string path = std::string(kFortunesDir) + "/" + name;
    if (!std::filesystem::exists(path)) return {};
    files.push_back(path);
  }
  return files;
}

// mixtral-tiny with a smaller vocabulary, written into dir; returns the model file.
inline std::string write_small_model(const TempDir& dir, int64_t vocab_size) {
  Json model = read_json_file(profile_path("models/mixtral-tiny.json"));
  model["name"] = "mixtral-tiny-v" + std::to_string(vocab_size);
  model["vocab_size"] = vocab_size;
  return dir.write("model.json", model);
}

// A one-rank plan for the local CPU profile.
inline CommandResult make_plan(const std::string& model_file, const std::string& out, int64_t seq_len,
                               int64_t global_batch_tokens, const std::string& precision, int64_t max_micro_batch) {
  return run_command(moeplan_command("search --gpus 1 --instance local-cpu --model " + model_file + " --seq-len " +
                                     std::to_string(seq_len) + " --global-batch-tokens " +
                                     std::to_string(global_batch_tokens) + " --precision " + precision +
                                     " --max-micro-batch " + std::to_string(max_micro_batch) + " --out " + out));
}

inline CommandResult prepare_data(const std::vector<std::string>& inputs, const std::string& out, int64_t vocab_size,
                                  int64_t block_size) {
  std::string files;
  for (const std::string& f : inputs) files += " " + f;
  return run_command(moeplan_command("data prepare --input" + files + " --out " + out + " --vocab-size " +
                                     std::to_string(vocab_size) + " --block-size " + std::to_string(block_size) +
                                     " --document-separator %"));
}

// The metrics.jsonl lines of a run, parsed.
inline std::vector<Json> read_metrics(const std::string& run_dir) {
  std::vector<Json> lines;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(Json::parse(line));
  return lines;
}

}  // namespace moeplan::test
