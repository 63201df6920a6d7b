// Writes the seed inputs of the executor's fuzz targets with the executor's own writers, so that
// the seeds are files moeplan really makes: tensor files, checkpoints of one rank and of two
// (slices and column blocks), their Hugging Face export, and a prepared data folder.
//
//   moeplan-fuzz-seeds OUT_DIR [DATA_DIR]
//
// writes OUT_DIR/<target>/<seed> for tensor_file, checkpoint and hf_checkpoint, and
// OUT_DIR/tokens/<seed> from DATA_DIR, a folder `moeplan data prepare` wrote (the tokenizer
// does not share a process with LibTorch). fuzz/corpus/ was made this way.
#include "moeplan/executor/libtorch.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fuzz_support.h"
#include "moeplan/core/errors.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tensor_file.h"
#include "moeplan/executor/model/hf_checkpoint.h"
#include "moeplan/executor/model/mixtral.h"

namespace {

using namespace moeplan;
using namespace moeplan::executor;
namespace fs = std::filesystem;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_seed(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
  std::printf("%s (%zu bytes)\n", (dir / name).c_str(), bytes.size());
}

// The tiny model's parameters and AdamW moments, as a one-rank run holds them.
NamedTensors whole_state(torch::ScalarType dtype) {
  torch::manual_seed(0);
  NamedTensors state;
  for (const ParamInfo& info : mixtral_parameters(fuzz::tiny_model()))
    for (const char* prefix : {"param/", "exp_avg/", "exp_avg_sq/"})
      state.emplace_back(prefix + info.name, torch::randn(info.shape).to(dtype));
  return state;
}

// The same state over two ranks: every tensor's flattened elements split in two at the
// middle, as hybrid sharding holds them; matrices with an even number of columns split by
// columns first, as tensor parallelism holds them.
std::vector<NamedTensors> two_rank_state() {
  std::vector<NamedTensors> ranks(2);
  for (const auto& [name, t] : whole_state(torch::kFloat)) {
    if (t.dim() == 2 && t.size(1) % 2 == 0 && name.find("experts") != std::string::npos) {
      const int64_t half = t.size(1) / 2, total = t.size(1);
      for (int64_t r = 0; r < 2; ++r)
        ranks[static_cast<size_t>(r)].emplace_back(
            name + "#cols" + std::to_string(r * half) + ":" + std::to_string((r + 1) * half) + "of" +
                std::to_string(total) + "@0",
            t.narrow(1, r * half, half).contiguous());
      continue;
    }
    const torch::Tensor flat = t.flatten();
    const int64_t half = flat.numel() / 2;
    ranks[0].emplace_back(name + "@0", flat.narrow(0, 0, half).clone());
    ranks[1].emplace_back(name + "@" + std::to_string(half), flat.narrow(0, half, flat.numel() - half).clone());
  }
  return ranks;
}

Json checkpoint_state() {
  Json state;
  state["samples_consumed"] = 16;
  state["optimizer_step"] = 2;
  state["precision"] = "bf16";
  state["seed"] = 1234;
  state["model"] = to_json(fuzz::tiny_model());
  return state;
}

// A step folder written as a run writes one; returns it.
fs::path write_checkpoint(const fs::path& work, const std::vector<NamedTensors>& ranks) {
  const std::string dir = begin_checkpoint((work / "checkpoints").string(), 2);
  std::vector<CheckpointFile> files;
  for (size_t r = 0; r < ranks.size(); ++r) files.push_back(write_checkpoint_shard(dir, static_cast<int64_t>(r), ranks[r]));
  commit_checkpoint(dir, 2, checkpoint_state(), files);
  return dir;
}

// A checkpoint as the checkpoint target's input: its options byte, the manifest, the shards.
void checkpoint_seeds(const fs::path& out, const fs::path& step_dir, const std::string& name) {
  std::vector<std::string> parts = {read_bytes(step_dir / "manifest.json")};
  for (const char* shard : {"rank-00000.safetensors", "rank-00001.safetensors"})
    parts.push_back(fs::exists(step_dir / shard) ? read_bytes(step_dir / shard) : "");
  write_seed(out / "checkpoint", name, fuzz::join_files('0', parts));
  write_seed(out / "checkpoint", name + "-true-checksums", fuzz::join_files('1', parts));
}

int write_all(const fs::path& out, const fs::path& data_dir) {
  const fs::path work = fs::temp_directory_path() / "moeplan-fuzz-seeds";
  fs::remove_all(work);
  fs::create_directories(work);

  // Tensor files: the whole state in float32 and in bfloat16 (with metadata), and an empty one.
  for (const auto& [name, dtype, metadata] :
       {std::tuple{"state-f32", torch::kFloat, std::map<std::string, std::string>{}},
        std::tuple{"state-bf16", torch::kBFloat16, std::map<std::string, std::string>{{"format", "pt"}}},
        std::tuple{"empty", torch::kFloat, std::map<std::string, std::string>{}}}) {
    const fs::path path = work / (std::string(name) + ".safetensors");
    write_tensor_file(path.string(), std::string(name) == "empty" ? NamedTensors{} : whole_state(dtype), metadata);
    write_seed(out / "tensor_file", name, read_bytes(path));
  }

  // Checkpoints of one rank and of two.
  const fs::path one = write_checkpoint(work / "one", {whole_state(torch::kFloat)});
  checkpoint_seeds(out, one, "one-rank");
  checkpoint_seeds(out, write_checkpoint(work / "two", two_rank_state()), "two-ranks");

  // The one-rank checkpoint exported for Hugging Face: with its index, and as a lone
  // model.safetensors.
  const fs::path hf = work / "hf";
  const HfExport exported = export_hf_checkpoint(one.string(), hf.string());
  std::string shard;
  for (const std::string& f : exported.files)
    if (f.ends_with(".safetensors")) shard = read_bytes(hf / f);
  const std::string config = read_bytes(hf / "config.json");
  write_seed(out / "hf_checkpoint", "indexed",
             fuzz::join_files('0', {config, read_bytes(hf / "model.safetensors.index.json"), shard}));
  write_seed(out / "hf_checkpoint", "single-file", fuzz::join_files('0', {config, "", shard}));

  if (!data_dir.empty()) {
    std::vector<std::string> parts;
    for (const char* name : {"manifest.json", "index.bin", "tokens.bin"}) parts.push_back(read_bytes(data_dir / name));
    write_seed(out / "tokens", "prepared", fuzz::join_files('0', parts));
    write_seed(out / "tokens", "prepared-true-checksums", fuzz::join_files('1', parts));
  }
  fs::remove_all(work);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: moeplan-fuzz-seeds OUT_DIR [DATA_DIR]\n");
    return 2;
  }
  try {
    return write_all(argv[1], argc == 3 ? argv[2] : "");
  } catch (const InputError& e) {
    for (const std::string& line : e.lines()) std::fprintf(stderr, "moeplan-fuzz-seeds: %s\n", line.c_str());
    return 1;
  }
}
