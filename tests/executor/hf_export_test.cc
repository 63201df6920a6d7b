// `moeplan export CHECKPOINT --hf DIR`: a sharded checkpoint of real training written as the
// folder transformers loads (config.json, safetensors shards, their index), checked tensor by
// tensor against the checkpoint's slices, and by an independent reader where python3 is here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/executor/checkpoint.h"
#include "moeplan/executor/mixtral.h"
#include "moeplan/executor/tensor_file.h"
#include "run_fixture.h"
#include "test_support.h"

namespace moeplan::executor {
namespace {

namespace fs = std::filesystem;
using test::Command;
using test::kFortunesDir;
using test::run_moeplan;
using test::show;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The safetensors layout read without moeplan's code: header length, JSON header, each
// tensor's byte range exactly dtype x shape, ranges back to back over the whole data; the
// index's total equals the data.
constexpr char kIndependentReader[] = R"PY(
import json, struct, sys, os
d = sys.argv[1]
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
size = {"F32": 4, "BF16": 2, "F16": 2}
total = 0
for f in sorted(set(index["weight_map"].values())):
    raw = open(os.path.join(d, f), "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}, f
    data = len(raw) - 8 - n
    spans = sorted((v["data_offsets"], k, v) for k, v in header.items())
    at = 0
    for (b, e), k, v in spans:
        count = 1
        for s in v["shape"]:
            count *= s
        assert b == at and e - b == count * size[v["dtype"]], k
        assert index["weight_map"][k] == f, k
        at = e
    assert at == data, f
    total += data
assert total == index["metadata"]["total_size"]
print("ok", len(index["weight_map"]))
)PY";

class HfExport : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::vector<std::string> inputs = test::fortune_files({"fortunes", "wisdom", "science"});
    if (inputs.empty()) return;
    dir_ = new test::TempDir();
    prepared_ = test::prepare_data(inputs, dir_->file("data"), 512, 64);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (dir_ == nullptr) GTEST_SKIP() << kFortunesDir << " is missing: install the Debian package fortunes";
    ASSERT_EQ(prepared_.exit_code, 0) << show(prepared_);
  }
  inline static test::TempDir* dir_ = nullptr;
  inline static Command prepared_;
};

TEST_F(HfExport, ShardedCheckpointBecomesAHuggingFaceFolder) {
  const test::TempDir tmp;
  const std::string model_file = test::write_small_model(tmp, 512);
  const ModelSpec model = read_model_file(model_file);
  // Two ranks sharding every parameter (E1 S2): each tensor is split between the ranks' files.
  const std::string plan = tmp.file("plan.json");
  const Command made = run_moeplan("search --gpus 2 --instance local-cpu --model " + model_file +
                                   " --seq-len 64 --global-batch-tokens 256 --precision fp32 --max-micro-batch 1"
                                   " --expert-parallel-degree 1 --hybrid-shard-degree 2 --tensor-parallel-degree 1"
                                   " --pipeline-parallel-degree 1 --out " + plan);
  ASSERT_EQ(made.exit_code, 0) << show(made);
  const std::string run = tmp.file("run");
  const Command trained = run_moeplan("run " + plan + " --data " + dir_->file("data") + " --out " + run +
                                      " --steps 1 --checkpoint-every 1 --threads 1");
  ASSERT_EQ(trained.exit_code, 0) << show(trained);

  const std::string hf = tmp.file("hf");
  const Command exported = run_moeplan("export " + run + " --hf " + hf + " --max-shard-bytes 2000000");
  ASSERT_EQ(exported.exit_code, 0) << show(exported);
  EXPECT_TRUE(contains(exported.out, "exported step 1 of " + run + "/checkpoints/step-00000001")) << show(exported);

  // config.json is the model.
  ModelSpec back = read_model_file(hf + "/config.json");
  EXPECT_EQ(back.name, model.name);
  back.source = model.source;
  EXPECT_EQ(back, model);
  EXPECT_EQ(read_json_file(hf + "/config.json")["torch_dtype"], "float32");

  // Every parameter once, in a shard the index names, with Hugging Face's name and shape, and
  // the values of the checkpoint's slices put back together.
  const LoadedCheckpoint ck = open_checkpoint(run + "/checkpoints/step-00000001");
  std::map<std::string, std::map<int64_t, torch::Tensor>> slices;
  for (const CheckpointFile& f : ck.files)
    for (auto& [name, t] : read_checkpoint_shard(ck, f.name).tensors) {
      if (name.rfind("param/", 0) != 0) continue;
      const size_t at = name.find('@');
      ASSERT_NE(at, std::string::npos) << name;  // sharded: every parameter in slices
      slices[name.substr(6, at - 6)][std::stoll(name.substr(at + 1))] = t;
    }
  const Json index = read_json_file(hf + "/model.safetensors.index.json");
  const std::vector<ParamInfo> params = mixtral_parameters(model);
  ASSERT_EQ(index["weight_map"].size(), params.size());
  std::map<std::string, torch::Tensor> exported_tensors;
  std::set<std::string> shard_files;
  for (const auto& [name, file] : index["weight_map"].items()) shard_files.insert(file.get<std::string>());
  EXPECT_GT(shard_files.size(), 1u) << "2 MB shards of a 3.5M-parameter fp32 model";
  for (const std::string& file : shard_files) {
    const TensorFile t = read_tensor_file(hf + "/" + file);
    EXPECT_EQ(t.metadata.at("format"), "pt");
    for (const auto& [name, tensor] : t.tensors) {
      EXPECT_EQ(index["weight_map"][name], file) << name;
      exported_tensors[name] = tensor;
    }
  }
  for (const ParamInfo& info : params) {
    ASSERT_TRUE(exported_tensors.count(info.name)) << info.name;
    const torch::Tensor& t = exported_tensors[info.name];
    EXPECT_EQ(t.sizes().vec(), info.shape) << info.name;
    std::vector<torch::Tensor> parts;
    for (const auto& [offset, part] : slices[info.name]) parts.push_back(part.flatten());
    EXPECT_TRUE(torch::equal(t.flatten(), torch::cat(parts))) << info.name;
  }

  // The same checkpoint exported again gives the same bytes.
  const std::string again = tmp.file("hf-again");
  ASSERT_EQ(run_moeplan("export " + run + " --hf " + again + " --max-shard-bytes 2000000").exit_code, 0);
  for (const auto& entry : fs::directory_iterator(hf))
    EXPECT_EQ(bytes_of(entry.path()), bytes_of(fs::path(again) / entry.path().filename())) << entry.path();

  // Nothing is overwritten, and a folder without a checkpoint is named.
  const Command twice = run_moeplan("export " + run + " --hf " + hf);
  EXPECT_EQ(twice.exit_code, 2) << show(twice);
  EXPECT_TRUE(contains(twice.err, "moeplan: error: export: " + hf + ": already holds a Hugging Face checkpoint"))
      << show(twice);
  const Command nothing = run_moeplan("export " + tmp.file("nowhere") + " --hf " + tmp.file("hf-none"));
  EXPECT_EQ(nothing.exit_code, 2) << show(nothing);
  EXPECT_TRUE(contains(nothing.err, tmp.file("nowhere") + ": no checkpoint here")) << show(nothing);

  // An independent reader agrees with the layout.
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 is not installed: the independent layout check did not run";
  }
  const std::string script = tmp.write("check.py", std::string(kIndependentReader));
  const Command checked = test::run_command("python3 " + script + " " + hf);
  EXPECT_EQ(checked.exit_code, 0) << show(checked);
  EXPECT_TRUE(contains(checked.out, "ok " + std::to_string(params.size()))) << show(checked);
}

}  // namespace
}  // namespace moeplan::executor
