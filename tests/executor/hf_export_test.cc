// `moeplan export CHECKPOINT --hf DIR`: a sharded checkpoint of real training written as the
// folder transformers loads (config.json, safetensors shards, their index), checked tensor by
// tensor against the checkpoint's slices, and by an independent reader where python3 is here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <functional>
#include <array>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tensor_file.h"
#include "moeplan/executor/io/tokens.h"
#include "moeplan/executor/model/expert_bias.h"
#include "moeplan/executor/model/hf_checkpoint.h"
#include "moeplan/executor/model/mixtral.h"
#include "moeplan/executor/training/parallel_trainer.h"
#include "run_fixture.h"
#include "test_support.h"

namespace moeplan::executor {
namespace {

namespace fs = std::filesystem;
using test::Command;
using test::kFortunesDir;
using test::run_moeplan;
using test::show;

using test::contains;

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

// Mixtral's forward pass as Hugging Face's modeling_mixtral.py defines it, written again in
// PyTorch from the folder alone (config.json, the index, safetensors parsed here): RMSNorm in
// fp32, rotate_half RoPE, grouped-query attention with a causal mask, softmax top-k routing
// renormalised over the k experts, SwiGLU experts w2(silu(w1 x) * w3 x). Prints the largest
// difference from the logits moeplan computed for the same tokens.
constexpr char kReferenceMixtral[] = R"PY(
import json, math, os, struct, sys
import torch
d, ids_path, logits_path = sys.argv[1:4]
cfg = json.load(open(os.path.join(d, "config.json")))
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
types = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
W = {}
for f in sorted(set(index["weight_map"].values())):
    raw = open(os.path.join(d, f), "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    for name, v in header.items():
        b, e = v["data_offsets"]
        W[name] = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=types[v["dtype"]]).reshape(v["shape"]).float()
H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
hd = cfg.get("head_dim") or H // nh
eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
assert cfg["hidden_act"] == "silu" and not cfg.get("tie_word_embeddings")

def norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

def rotate_half(x):
    return torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)

ids = torch.frombuffer(bytearray(open(ids_path, "rb").read()), dtype=torch.int64)
expected = torch.frombuffer(bytearray(open(logits_path, "rb").read()), dtype=torch.float32)
B = int(sys.argv[4]); T = ids.numel() // B
ids = ids.reshape(B, T)
inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
freqs = torch.outer(torch.arange(T).float(), inv_freq)
emb = torch.cat((freqs, freqs), dim=-1)
cos, sin = emb.cos(), emb.sin()
mask = torch.full((T, T), float("-inf")).triu(1)
if cfg.get("sliding_window"):
    mask = mask.masked_fill(torch.arange(T)[:, None] - torch.arange(T)[None, :] >= cfg["sliding_window"], float("-inf"))
h = W["model.embed_tokens.weight"][ids]
for l in range(cfg["num_hidden_layers"]):
    p = "model.layers.%d." % l
    x = norm(h, W[p + "input_layernorm.weight"])
    q = (x @ W[p + "self_attn.q_proj.weight"].T).view(B, T, nh, hd).transpose(1, 2)
    kk = (x @ W[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
    v = (x @ W[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
    q, kk = q * cos + rotate_half(q) * sin, kk * cos + rotate_half(kk) * sin
    kk, v = kk.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    a = torch.softmax(q @ kk.transpose(2, 3) / math.sqrt(hd) + mask, dim=-1) @ v
    h = h + a.transpose(1, 2).reshape(B, T, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
    x = norm(h, W[p + "post_attention_layernorm.weight"]).reshape(B * T, H)
    probs = torch.softmax(x @ W[p + "block_sparse_moe.gate.weight"].T, dim=-1)
    top, chosen = torch.topk(probs, k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for j in range(E):
        e = p + "block_sparse_moe.experts.%d." % j
        rows, slot = torch.nonzero(chosen == j, as_tuple=True)
        y = (torch.nn.functional.silu(x[rows] @ W[e + "w1.weight"].T) * (x[rows] @ W[e + "w3.weight"].T)) @ W[e + "w2.weight"].T
        out.index_add_(0, rows, y * top[rows, slot, None])
    h = h + out.view(B, T, H)
head = W["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else W["lm_head.weight"]
logits = norm(h, W["model.norm.weight"]) @ head.T
got = expected.reshape(logits.shape)
print("max_abs_diff %.3e max_abs_logit %.3e" % ((logits - got).abs().max().item(), logits.abs().max().item()))
)PY";

// The folder loaded by transformers itself (AutoModelForCausalLM: MixtralForCausalLM,
// Qwen3MoeForCausalLM or DeepseekV3ForCausalLM by config.json), in fp32 with eager attention; prints the class and the
// largest difference from moeplan's logits for the same tokens.
constexpr char kTransformersLogits[] = R"PY(
import sys
import torch, transformers
d, ids_path, logits_path, B = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
model.eval()
ids = torch.frombuffer(bytearray(open(ids_path, "rb").read()), dtype=torch.int64).reshape(B, -1)
expected = torch.frombuffer(bytearray(open(logits_path, "rb").read()), dtype=torch.float32)
with torch.no_grad():
    logits = model(input_ids=ids).logits.float()
got = expected.reshape(logits.shape)
print("%s max_abs_diff %.3e max_abs_logit %.3e" % (type(model).__name__, (logits - got).abs().max().item(),
                                                   logits.abs().max().item()))
)PY";

// moeplan's logits for two sequences of `data` from the Hugging Face folder `hf` (read by
// read_hf_parameters), against those transformers computes from the same folder; skips where
// the wheel's Python has no transformers.
void expect_transformers_agrees(const std::string& hf, const std::string& model_file, const std::string& data,
                                const std::string& architecture) {
  const std::string python = MOEPLAN_TORCH_PYTHON;
  if (std::system((python + " -W ignore -c 'import transformers' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << python << " cannot import transformers (scripts/install-torch installs it): the exported folder "
                              "was not loaded by transformers";
  const test::TempDir tmp;
  const ModelSpec model = read_model_file(model_file);
  Diagnostics d;
  const SlicedState state = read_hf_parameters(hf, model, torch::kFloat);
  std::vector<torch::Tensor> tensors;
  for (const ParamInfo& info : mixtral_parameters(model)) tensors.push_back(state.whole("param/" + info.name, info.shape, d));
  torch::Tensor bias = initial_expert_bias(model);  // a sigmoid router's, from the folder
  read_expert_bias(state, model, bias, /*required=*/true, d);
  ASSERT_TRUE(d.empty());
  const torch::Tensor ids = TokenDataset::open(data).blocks({3, 11});
  torch::NoGradGuard no_grad;
  const torch::Tensor logits =
      mixtral_forward(model, MixtralWeights::bind(model, tensors, bias), ids, LoadBalancing::kAuxLoss).logits.contiguous();
  auto write = [&](const std::string& name, const torch::Tensor& t) {
    const std::string path = tmp.file(name);
    std::ofstream(path, std::ios::binary).write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    return path;
  };
  const std::string script = tmp.write("transformers_logits.py", std::string(kTransformersLogits));
  const Command r = test::run_command(python + " -W ignore " + script + " " + hf + " " + write("ids", ids.contiguous()) +
                                      " " + write("logits", logits) + " " + std::to_string(ids.size(0)));
  ASSERT_EQ(r.exit_code, 0) << show(r);
  char loaded[128] = {};
  double diff = 1, largest = 0;
  ASSERT_EQ(std::sscanf(r.out.c_str(), "%127s max_abs_diff %lf max_abs_logit %lf", loaded, &diff, &largest), 3) << show(r);
  std::cout << loaded << ": largest logit difference " << diff << " (largest logit " << largest << ")\n";
  EXPECT_EQ(std::string(loaded), architecture);
  EXPECT_GT(largest, 0.1) << "logits of a trained model, not zeros";
  EXPECT_LE(diff, 1e-4 * std::max(1.0, largest)) << show(r);
}

// A plan for `model` on `gpus` local CPU ranks, E and S as given (T = P = 1), 64-token
// sequences, one a micro-batch, learning rate `lr`; written to `path`.
std::string tiny_plan(const std::string& model, const std::string& path, int64_t gpus, int64_t e, int64_t s,
                      const std::string& lr) {
  const Command made = run_moeplan("search --gpus " + std::to_string(gpus) + " --instance local-cpu --model " + model +
                                   " --seq-len 64 --global-batch-tokens 256 --precision fp32 --max-micro-batch 1"
                                   " --expert-parallel-degree " + std::to_string(e) + " --hybrid-shard-degree " +
                                   std::to_string(s) + " --tensor-parallel-degree 1 --pipeline-parallel-degree 1"
                                   " --learning-rate " + lr + " --min-learning-rate 0 --out " + path);
  EXPECT_EQ(made.exit_code, 0) << show(made);
  return path;
}

// Import the folder `hf` under a plan of `model` on one rank and on two (experts split), train 2
// steps at learning rate 0, export: every file the same bytes as `hf`, and the same first loss on
// both layouts.
void expect_round_trip_on_either_layout(const std::string& hf, const std::string& model, const std::string& data,
                                        const test::TempDir& tmp) {
  std::vector<double> losses;
  for (int64_t gpus : {1, 2}) {
    const std::string run = tmp.file("run-" + std::to_string(gpus));
    const std::string plan = tiny_plan(model, tmp.file("plan-" + std::to_string(gpus) + ".json"), gpus, gpus, 1, "0");
    const Command trained = run_moeplan("run " + plan + " --data " + data + " --out " + run +
                                        " --steps 2 --checkpoint-every 2 --threads 1 --init-from " + hf);
    ASSERT_EQ(trained.exit_code, 0) << show(trained);
    losses.push_back(test::read_metrics(run)[0]["loss"].get<double>());
    const std::string back = tmp.file("hf-back-" + std::to_string(gpus));
    ASSERT_EQ(run_moeplan("export " + run + " --hf " + back + " --max-shard-bytes 3000000").exit_code, 0);
    size_t files = 0;
    for (const auto& entry : fs::directory_iterator(hf)) {
      EXPECT_EQ(bytes_of(entry.path()), bytes_of(fs::path(back) / entry.path().filename())) << entry.path();
      ++files;
    }
    EXPECT_GE(files, 3u);
  }
  EXPECT_NEAR(losses[1], losses[0], 1e-5 * losses[0]);
}

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

// A folder exported from a real 2-rank checkpoint, made once for the import tests.
class HfImport : public HfExport {
 protected:
  static void SetUpTestSuite() {
    HfExport::SetUpTestSuite();
    if (dir_ == nullptr) return;
    model_ = test::write_small_model(*dir_, 512);
    const std::string plan = dir_->file("plan2.json");
    made_ = run_moeplan("search --gpus 2 --instance local-cpu --model " + model_ +
                        " --seq-len 64 --global-batch-tokens 256 --precision fp32 --max-micro-batch 1"
                        " --expert-parallel-degree 2 --hybrid-shard-degree 1 --tensor-parallel-degree 1"
                        " --pipeline-parallel-degree 1 --out " + plan);
    if (made_.exit_code != 0) return;
    made_ = run_moeplan("run " + plan + " --data " + dir_->file("data") + " --out " + dir_->file("run2") +
                        " --steps 1 --checkpoint-every 1 --threads 1");
    if (made_.exit_code != 0) return;
    made_ = run_moeplan("export " + dir_->file("run2") + " --hf " + dir_->file("hf2") + " --max-shard-bytes 3000000");
  }
  void SetUp() override {
    HfExport::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(made_.exit_code, 0) << show(made_);
  }
  static std::string hf() { return dir_->file("hf2"); }
  // A plan of `gpus` ranks with E and S as given, learning rate `lr`, for the tiny model.
  static std::string plan(const test::TempDir& tmp, int64_t gpus, int64_t e, int64_t s, const std::string& lr) {
    return tiny_plan(model_, tmp.file("plan-" + std::to_string(gpus) + ".json"), gpus, e, s, lr);
  }
  inline static std::string model_;
  inline static Command made_;
};

// Export, import, export: with a learning rate of 0 a step changes no weight, so the second
// export is the first, byte for byte.
TEST_F(HfImport, RoundTripIsByteIdentical) {
  const test::TempDir tmp;
  const std::string run = tmp.file("run");
  const Command trained = run_moeplan("run " + plan(tmp, 1, 1, 1, "0") + " --data " + dir_->file("data") + " --out " +
                                      run + " --steps 1 --checkpoint-every 1 --threads 1 --init-from " + hf());
  ASSERT_EQ(trained.exit_code, 0) << show(trained);
  EXPECT_TRUE(contains(trained.out, "started from the Hugging Face model in " + hf())) << show(trained);
  const std::string back = tmp.file("hf-back");
  ASSERT_EQ(run_moeplan("export " + run + " --hf " + back + " --max-shard-bytes 3000000").exit_code, 0);
  size_t files = 0;
  for (const auto& entry : fs::directory_iterator(hf())) {
    EXPECT_EQ(bytes_of(entry.path()), bytes_of(fs::path(back) / entry.path().filename())) << entry.path();
    ++files;
  }
  EXPECT_GE(files, 4u);  // config, index and at least two shards
}

// The same weights give the same logits under E2 S2 (4 ranks, each reading only its shard
// and experts) as on one rank: the first step's loss agrees to float rounding.
TEST_F(HfImport, FourRanksAndOneRankStartFromTheSameModel) {
  const test::TempDir tmp;
  std::vector<double> losses;
  for (auto [gpus, e, s] : {std::array<int64_t, 3>{1, 1, 1}, std::array<int64_t, 3>{4, 2, 2}}) {
    const std::string run = tmp.file("run-" + std::to_string(gpus));
    const Command trained = run_moeplan("run " + plan(tmp, gpus, e, s, "0.001") + " --data " + dir_->file("data") +
                                        " --out " + run + " --steps 1 --threads 1 --init-from " + hf());
    ASSERT_EQ(trained.exit_code, 0) << show(trained);
    const std::vector<Json> metrics = test::read_metrics(run);
    ASSERT_EQ(metrics.size(), 1u);
    losses.push_back(metrics[0]["loss"].get<double>());
  }
  EXPECT_NEAR(losses[1], losses[0], 1e-5 * losses[0]);
  // Trained weights, not random ones: the random start's loss is about ln(512) = 6.24.
  const std::string fresh = tmp.file("fresh");
  ASSERT_EQ(run_moeplan("run " + plan(tmp, 1, 1, 1, "0.001") + " --data " + dir_->file("data") + " --out " + fresh +
                        " --steps 1 --threads 1").exit_code, 0);
  EXPECT_NE(test::read_metrics(fresh)[0]["loss"].get<double>(), losses[0]);
}

// The exported folder read by an independent Mixtral (kReferenceMixtral, in the PyTorch of the
// wheel the executor links): the logits moeplan computes from the folder for two sequences of
// real text are its logits.
TEST_F(HfImport, AnIndependentMixtralGivesTheSameLogits) {
  const std::string python = MOEPLAN_TORCH_PYTHON;
  if (std::system((python + " -W ignore -c 'import torch' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << python << " cannot import torch (scripts/install-torch): the reference Mixtral did not run";
  const test::TempDir tmp;
  const ModelSpec model = read_model_file(model_);
  Diagnostics d;
  const SlicedState state = read_hf_parameters(hf(), model, torch::kFloat);
  std::vector<torch::Tensor> tensors;
  for (const ParamInfo& info : mixtral_parameters(model)) tensors.push_back(state.whole("param/" + info.name, info.shape, d));
  ASSERT_TRUE(d.empty());
  const torch::Tensor ids = TokenDataset::open(dir_->file("data")).blocks({3, 11});
  torch::NoGradGuard no_grad;
  const ForwardResult out =
      mixtral_forward(model, MixtralWeights::bind(model, tensors), ids, LoadBalancing::kAuxLoss);
  const torch::Tensor logits = out.logits.contiguous();
  ASSERT_EQ(logits.scalar_type(), torch::kFloat);
  auto write = [&](const std::string& name, const torch::Tensor& t) {
    const std::string path = tmp.file(name);
    std::ofstream(path, std::ios::binary).write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    return path;
  };
  const std::string script = tmp.write("mixtral.py", std::string(kReferenceMixtral));
  const Command r = test::run_command(python + " -W ignore " + script + " " + hf() + " " + write("ids", ids.contiguous()) + " " +
                                      write("logits", logits) + " " + std::to_string(ids.size(0)));
  ASSERT_EQ(r.exit_code, 0) << show(r);
  double diff = 1, largest = 0;
  ASSERT_EQ(std::sscanf(r.out.c_str(), "max_abs_diff %lf max_abs_logit %lf", &diff, &largest), 2) << show(r);
  std::cout << "largest logit difference " << diff << " (largest logit " << largest << ")\n";
  EXPECT_GT(largest, 0.1) << "logits of a trained model, not zeros";
  EXPECT_LE(diff, 1e-4 * std::max(1.0, largest)) << show(r);
}

TEST_F(HfImport, TransformersLoadsTheFolderAsMixtral) {
  expect_transformers_agrees(hf(), model_, dir_->file("data"), "MixtralForCausalLM");
}

// A copy of the exported folder with one file replaced; the run must refuse it naming what is
// wrong, before training.
TEST_F(HfImport, MalformedFoldersAreRefusedNamingTheFault) {
  const test::TempDir tmp;
  const Json index = read_json_file(hf() + "/model.safetensors.index.json");
  const std::string embed = "model.embed_tokens.weight";
  const std::string embed_file = index["weight_map"][embed].get<std::string>();
  auto refused = [&](const std::string& name, const std::function<void(const std::string&)>& spoil) {
    const std::string copy = tmp.file(name);
    fs::copy(hf(), copy, fs::copy_options::recursive);
    spoil(copy);
    const Command r = run_moeplan("run " + plan(tmp, 1, 1, 1, "0.001") + " --data " + dir_->file("data") + " --out " +
                                  tmp.file("run-" + name) + " --steps 1 --threads 1 --init-from " + copy);
    EXPECT_EQ(r.exit_code, 2) << name << show(r);
    EXPECT_FALSE(fs::exists(tmp.file("run-" + name) + "/metrics.jsonl")) << name;
    return r.err;
  };
  // The header length says more bytes than the file has.
  std::string err = refused("header-length", [&](const std::string& dir) {
    std::string bytes = bytes_of(fs::path(dir) / embed_file);
    bytes[6] = '\x7f';
    std::ofstream(fs::path(dir) / embed_file, std::ios::binary) << bytes;
  });
  EXPECT_TRUE(contains(err, embed_file + ": header: length ")) << err;
  // The embedding's byte range ends past the data; then its dtype is not floating point; then
  // its shape is transposed.
  auto rewrite_embedding = [&](const std::string& dir, const std::function<void(Json&)>& edit) {
    const std::string path = (fs::path(dir) / embed_file).string();
    const std::string bytes = bytes_of(path);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[static_cast<size_t>(i)])) << (8 * i);
    Json header = Json::parse(bytes.substr(8, n));
    edit(header[embed]);
    const std::string text = header.dump();
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
    std::ofstream(path, std::ios::binary) << out << text << bytes.substr(8 + n);
  };
  err = refused("offsets", [&](const std::string& dir) {
    rewrite_embedding(dir, [](Json& e) { e["data_offsets"][1] = e["data_offsets"][1].get<uint64_t>() + (1 << 30); });
  });
  EXPECT_TRUE(contains(err, embed_file + ": " + embed + ".data_offsets: [")) << err;
  err = refused("dtype", [&](const std::string& dir) {
    rewrite_embedding(dir, [](Json& e) { e["dtype"] = "I32"; });
  });
  EXPECT_TRUE(contains(err, embed + ".dtype: I32 is not a floating-point type")) << err;
  err = refused("shape", [&](const std::string& dir) {
    rewrite_embedding(dir, [](Json& e) { e["shape"] = Json::array({e["shape"][1], e["shape"][0]}); });
  });
  EXPECT_TRUE(contains(err, embed + ".shape: is [128, 512], the model needs [512, 128]")) << err;
  // A config of another model.
  err = refused("config", [&](const std::string& dir) {
    Json config = read_json_file(dir + "/config.json");
    config["hidden_size"] = 256;
    config["head_dim"] = 64;
    std::ofstream(dir + "/config.json") << config.dump(2);
  });
  EXPECT_TRUE(contains(err, "config.json: hidden_size: = 256, the plan's model has 128")) << err;
  // The index sends a tensor to a file outside the folder, where a whole copy of its shard lies.
  fs::copy_file(fs::path(hf()) / embed_file, tmp.file(embed_file));
  err = refused("outside", [&](const std::string& dir) {
    Json spoilt = index;
    spoilt["weight_map"][embed] = "../" + embed_file;
    std::ofstream(dir + "/model.safetensors.index.json") << spoilt.dump(2);
  });
  EXPECT_TRUE(contains(err, "weight_map." + embed + ": must name a file in the folder")) << err;
}

// Qwen3-MoE (qwen3-tiny: q/k norms, 32 experts, top-8): trained on 2 ranks with experts over
// both, exported as a Qwen3MoeForCausalLM folder, imported, exported again.
class HfQwen3 : public HfExport {
 protected:
  static void SetUpTestSuite() {
    HfExport::SetUpTestSuite();
    if (dir_ == nullptr) return;
    model_ = test::write_small_model(*dir_, 512, "qwen3-tiny");
    made_ = run_moeplan("run " + plan(*dir_, 2, 2, "0.001") + " --data " + dir_->file("data") + " --out " +
                        dir_->file("qwen3-run") + " --steps 2 --checkpoint-every 2 --threads 1");
    if (made_.exit_code != 0) return;
    made_ = run_moeplan("export " + dir_->file("qwen3-run") + " --hf " + hf() + " --max-shard-bytes 3000000");
  }
  void SetUp() override {
    HfExport::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(made_.exit_code, 0) << show(made_);
  }
  static std::string hf() { return dir_->file("qwen3-hf"); }
  static std::string plan(const test::TempDir& tmp, int64_t gpus, int64_t e, const std::string& lr) {
    return tiny_plan(model_, tmp.file("qwen3-plan-" + std::to_string(gpus) + "-" + lr + ".json"), gpus, e, 1, lr);
  }
  inline static std::string model_;
  inline static Command made_;
};

TEST_F(HfQwen3, ExportedFolderIsQwen3MoeWithItsNames) {
  const Json config = read_json_file(hf() + "/config.json");
  EXPECT_EQ(config["architectures"], Json::array({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(config["model_type"], "qwen3_moe");
  EXPECT_EQ(config["moe_intermediate_size"], 64);
  EXPECT_EQ(config["num_experts"], 32);
  EXPECT_EQ(config["num_experts_per_tok"], 8);
  EXPECT_EQ(config["norm_topk_prob"], true);
  // Read back as the same model.
  EXPECT_EQ(model_from_hf_config(config, "config.json").experts_per_token, 8);
  EXPECT_TRUE(model_from_hf_config(config, "config.json").qk_norm);
  const Json index = read_json_file(hf() + "/model.safetensors.index.json");
  for (const char* name : {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                           "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.experts.31.gate_proj.weight",
                           "model.layers.3.mlp.experts.31.up_proj.weight", "model.layers.3.mlp.experts.31.down_proj.weight"})
    EXPECT_TRUE(index["weight_map"].contains(name)) << name;
  for (const auto& [name, file] : index["weight_map"].items())
    EXPECT_EQ(name.find("block_sparse_moe"), std::string::npos) << name;
  // 3 + 4 layers x (9 + 32 x 3) tensors.
  EXPECT_EQ(index["weight_map"].size(), 3u + 4u * (9u + 32u * 3u));
}

// Import, train 2 steps at learning rate 0, export: the same bytes. The same folder on one
// rank and on two (experts split) gives the same first loss.
TEST_F(HfQwen3, RoundTripIsByteIdenticalOnEitherLayout) {
  const test::TempDir tmp;
  expect_round_trip_on_either_layout(hf(), model_, dir_->file("data"), tmp);
}

TEST_F(HfQwen3, TransformersLoadsTheFolderAsQwen3Moe) {
  expect_transformers_agrees(hf(), model_, dir_->file("data"), "Qwen3MoeForCausalLM");
}

// A folder whose router weighs the chosen experts otherwise than the plan's model is refused
// naming the field (a Qwen config without norm_topk_prob does not renormalise).
TEST_F(HfQwen3, AFolderWithoutRenormalisedWeightsIsRefused) {
  const test::TempDir tmp;
  const std::string copy = tmp.file("copy");
  fs::copy(hf(), copy, fs::copy_options::recursive);
  Json config = read_json_file(copy + "/config.json");
  config.erase("norm_topk_prob");
  std::ofstream(copy + "/config.json") << config.dump(2);
  const Command r = run_moeplan("run " + plan(tmp, 1, 1, "0.001") + " --data " + dir_->file("data") + " --out " +
                                tmp.file("run") + " --steps 1 --threads 1 --init-from " + copy);
  EXPECT_EQ(r.exit_code, 2) << show(r);
  EXPECT_TRUE(contains(r.err, "config.json: norm_topk_prob: = false (or its class's default), the plan's model has true"))
      << r.err;
}

// Qwen2-MoE's and DeepSeek-V2's router (norm_topk_prob false: each chosen expert weighted by its
// own probability) on qwen3-tiny's blocks: trained 2 steps, exported, loaded by transformers with
// the same logits, and started from by a run of the same model.
TEST_F(HfQwen3, ExpertsWeightedByTheirOwnProbabilityRoundTrip) {
  const test::TempDir tmp;
  Json spec = read_json_file(model_);
  spec["name"] = "qwen3-tiny-unnormalised";
  spec["norm_topk_prob"] = false;
  const std::string model = tmp.write("qwen3-unnormalised.json", spec);
  const std::string plan = tiny_plan(model, tmp.file("plan.json"), 1, 1, 1, "0.001");
  const Command trained = run_moeplan("run " + plan + " --data " + dir_->file("data") + " --out " + tmp.file("run") +
                                      " --steps 2 --checkpoint-every 2 --threads 1");
  ASSERT_EQ(trained.exit_code, 0) << show(trained);
  const std::string hf = tmp.file("hf");
  ASSERT_EQ(run_moeplan("export " + tmp.file("run") + " --hf " + hf).exit_code, 0);
  EXPECT_EQ(read_json_file(hf + "/config.json")["norm_topk_prob"], false);
  const Command resumed = run_moeplan("run " + plan + " --data " + dir_->file("data") + " --out " + tmp.file("again") +
                                      " --steps 1 --threads 1 --init-from " + hf);
  EXPECT_EQ(resumed.exit_code, 0) << show(resumed);
  expect_transformers_agrees(hf, model, dir_->file("data"), "Qwen3MoeForCausalLM");
}

// DeepSeek-V3 (deepseek-v3-tiny: latent attention, a dense first block, a shared expert, the
// sigmoid router in groups with its balancing bias, a multi-token prediction block): trained on 2
// ranks with experts over both, exported as a DeepseekV3ForCausalLM folder.
class HfDeepSeekV3 : public HfExport {
 protected:
  static void SetUpTestSuite() {
    HfExport::SetUpTestSuite();
    if (dir_ == nullptr) return;
    model_ = test::write_small_model(*dir_, 512, "deepseek-v3-tiny");
    made_ = run_moeplan("run " + tiny_plan(model_, dir_->file("deepseek-plan.json"), 2, 2, 1, "0.001") + " --data " +
                        dir_->file("data") + " --out " + dir_->file("deepseek-run") +
                        " --steps 2 --checkpoint-every 2 --threads 1");
    if (made_.exit_code != 0) return;
    made_ = run_moeplan("export " + dir_->file("deepseek-run") + " --hf " + hf() + " --max-shard-bytes 3000000");
  }
  void SetUp() override {
    HfExport::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(made_.exit_code, 0) << show(made_);
  }
  static std::string hf() { return dir_->file("deepseek-hf"); }
  inline static std::string model_;
  inline static Command made_;
};

TEST_F(HfDeepSeekV3, ExportedFolderIsDeepseekV3WithItsNames) {
  const Json config = read_json_file(hf() + "/config.json");
  EXPECT_EQ(config["architectures"], Json::array({"DeepseekV3ForCausalLM"}));
  EXPECT_EQ(config["model_type"], "deepseek_v3");
  EXPECT_EQ(config["moe_intermediate_size"], 64);
  EXPECT_EQ(config["intermediate_size"], 512);
  EXPECT_EQ(config["n_shared_experts"], 1);
  EXPECT_EQ(config["qk_nope_head_dim"], 32);
  EXPECT_EQ(config["qk_rope_head_dim"], 16);
  EXPECT_EQ(config["num_nextn_predict_layers"], 1);
  EXPECT_EQ(config["routed_scaling_factor"], 2.5);
  // Read back as the same model.
  const ModelSpec back = model_from_hf_config(config, "config.json");
  const ModelSpec ours = read_model_file(model_);
  EXPECT_EQ(back.head_dim, ours.head_dim);
  EXPECT_EQ(back.q_lora_rank, ours.q_lora_rank);
  EXPECT_EQ(back.router_groups, ours.router_groups);
  EXPECT_EQ(back.shared_expert_intermediate_size, ours.shared_expert_intermediate_size);
  EXPECT_EQ(back.moe_layers(), ours.moe_layers());
  EXPECT_EQ(back.mtp_layers, ours.mtp_layers);
  const Json index = read_json_file(hf() + "/model.safetensors.index.json");
  for (const char* name :
       {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.3.mlp.experts.31.up_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.hnorm.weight",
        "model.layers.4.eh_proj.weight", "model.layers.4.shared_head.norm.weight",
        "model.layers.4.mlp.experts.0.gate_proj.weight"})
    EXPECT_TRUE(index["weight_map"].contains(name)) << name;
  for (const auto& [name, file] : index["weight_map"].items()) {
    EXPECT_EQ(name.find("block_sparse_moe"), std::string::npos) << name;
    EXPECT_EQ(name.find(".w1."), std::string::npos) << name;
  }
  // The biases moved in the two steps, and are kept in fp32.
  const std::string bias = "model.layers.1.mlp.gate.e_score_correction_bias";
  const std::set<std::string> only{bias};
  const TensorFile file = read_tensor_file(hf() + "/" + index["weight_map"][bias].get<std::string>(), &only);
  ASSERT_EQ(file.tensors.size(), 1u);
  EXPECT_EQ(file.tensors[0].second.scalar_type(), torch::kFloat);
  EXPECT_GT(file.tensors[0].second.abs().max().item<double>(), 0.0);
}

// Import, train 2 steps with nothing moving (learning rate 0, the biases' rate 0), export: the
// same bytes, the biases among them, on one rank and on two; both start from the same loss.
TEST_F(HfDeepSeekV3, RoundTripIsByteIdenticalOnEitherLayout) {
  const test::TempDir tmp;
  Json still = read_json_file(model_);
  still["router_bias_update_rate"] = 0.0;
  const std::string model = tmp.write("deepseek-still.json", still);
  expect_round_trip_on_either_layout(hf(), model, dir_->file("data"), tmp);
}

TEST_F(HfDeepSeekV3, TransformersLoadsTheFolderAsDeepseekV3) {
  expect_transformers_agrees(hf(), model_, dir_->file("data"), "DeepseekV3ForCausalLM");
}

}  // namespace
}  // namespace moeplan::executor
