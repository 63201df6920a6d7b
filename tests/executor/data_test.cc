// Prepared data folders on real text: `moeplan data prepare` (run as the real binary, because
// SentencePiece's embedded protobuf must not share a process with LibTorch) followed by
// TokenDataset::open in this process. Damaged folders and bad options are clear errors.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/trace.h"
#include "moeplan/executor/io/tokens.h"
#include "moeplan/executor/training/trainer.h"
#include "moeplan/planner/search.h"
#include "run_fixture.h"
#include "test_support.h"

namespace moeplan::executor {
namespace {

namespace fs = std::filesystem;

using test::kFortunesDir;
constexpr int64_t kVocab = 512;  // small, so that training the tokenizer takes about a second
constexpr int64_t kBlock = 64;

using test::Command;
using test::run_moeplan;
using test::show;

using test::contains;

std::vector<std::string> fortune_files() {
  std::vector<std::string> files;
  for (const char* name : {"fortunes", "wisdom", "science", "computers"})
    files.push_back((std::filesystem::path(kFortunesDir) / name).string());
  return files;
}

std::string prepare_args(const std::vector<std::string>& inputs, const std::string& out, int64_t vocab_size,
                         int64_t block_size) {
  std::string args = "data prepare --input";
  for (const std::string& f : inputs) args += " " + f;
  return args + " --out " + out + " --vocab-size " + std::to_string(vocab_size) + " --block-size " +
         std::to_string(block_size) + " --document-separator %";
}

using test::write_bytes;

std::vector<uint16_t> decode_u16(const std::string& bytes) {
  std::vector<uint16_t> ids(bytes.size() / 2);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<uint16_t>(static_cast<unsigned char>(bytes[2 * i]) |
                                   (static_cast<unsigned char>(bytes[2 * i + 1]) << 8));
  return ids;
}

std::vector<uint64_t> decode_u64(const std::string& bytes) {
  std::vector<uint64_t> values(bytes.size() / 8);
  for (size_t i = 0; i < values.size(); ++i)
    for (int b = 0; b < 8; ++b) values[i] |= uint64_t{static_cast<unsigned char>(bytes[8 * i + b])} << (8 * b);
  return values;
}

std::string encode_u64(const std::vector<uint64_t>& values) {
  std::string bytes;
  for (const uint64_t v : values)
    for (int b = 0; b < 8; ++b) bytes.push_back(static_cast<char>((v >> (8 * b)) & 0xFF));
  return bytes;
}

// Rewrites a data file and puts its new size and CRC-32 into the manifest, so that open() gets
// past the checksum and the check under test is the one that has to catch the change.
void replace_with_valid_checksum(const std::string& dir, const std::string& name, const std::string& bytes) {
  write_bytes(dir + "/" + name, bytes);
  Json manifest = read_json_file(dir + "/manifest.json");
  manifest["files"][name]["bytes"] = bytes.size();
  manifest["files"][name]["crc32"] = crc32(bytes.data(), bytes.size());
  write_bytes(dir + "/manifest.json", manifest.dump(2));
}

// The lines of the InputError that TokenDataset::open(dir) throws; a test failure if it opens.
std::string open_error(const std::string& dir) {
  return test::input_error_of([&] { TokenDataset::open(dir); });
}

// One folder prepared from four fortune files for the whole suite; tests that damage files
// work on a copy.
class PreparedData : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::is_directory(kFortunesDir)) return;
    dir_ = new test::TempDir();
    prepared_ = run_moeplan(prepare_args(fortune_files(), dir_->file("data"), kVocab, kBlock));
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (dir_ == nullptr) GTEST_SKIP() << kFortunesDir << " is missing: install the Debian package fortunes";
    ASSERT_EQ(prepared_.exit_code, 0) << show(prepared_);
  }

  static std::string data() { return dir_->file("data"); }
  // A copy of the prepared folder inside `into`.
  static std::string copy_of_data(const test::TempDir& into) {
    const std::string copy = into.file("data");
    fs::copy(data(), copy, fs::copy_options::recursive);
    return copy;
  }

  inline static test::TempDir* dir_ = nullptr;
  inline static Command prepared_;
};

TEST_F(PreparedData, OpensWithTheShapeTheManifestGives) {
  const Json manifest = read_json_file(data() + "/manifest.json");
  const TokenDataset ds = TokenDataset::open(data());
  const int64_t tokens = manifest["tokens"].get<int64_t>();
  EXPECT_EQ(ds.num_tokens(), tokens);
  EXPECT_EQ(ds.block_size(), kBlock);
  EXPECT_EQ(ds.vocab_size(), kVocab);
  EXPECT_EQ(ds.num_blocks(), tokens / kBlock);
  EXPECT_EQ(manifest["blocks"].get<int64_t>(), tokens / kBlock);
  // Four fortune files are ~450 KB of text: thousands of blocks, not a handful.
  ASSERT_GT(ds.num_blocks(), 1000);

  const torch::Tensor two = ds.blocks({0, 1});
  EXPECT_EQ(two.sizes(), (std::vector<int64_t>{2, kBlock}));
  EXPECT_EQ(two.scalar_type(), torch::kLong);
  // Every document begins with <s> (id 1), like Llama's and Mixtral's tokenizers.
  EXPECT_EQ(two[0][0].item<int64_t>(), 1);

  std::vector<int64_t> all(static_cast<size_t>(ds.num_blocks()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  const torch::Tensor ids = ds.blocks(all);
  EXPECT_GE(ids.min().item<int64_t>(), 0);
  EXPECT_LT(ids.max().item<int64_t>(), kVocab);
  // The tokenizer is trained on this text, so its learned pieces are used; the 256 byte-fallback
  // pieces and 3 specials are mostly not (ASCII text is covered by learned pieces).
  const int64_t learned = kVocab - 256 - 3;
  EXPECT_GT(std::get<0>(torch::_unique(ids)).numel(), learned * 3 / 4);

  const double entropy = manifest["unigram_entropy_nats"].get<double>();
  EXPECT_GT(entropy, 0);
  EXPECT_LT(entropy, std::log(static_cast<double>(kVocab)));
  EXPECT_EQ(ds.unigram_entropy_nats(), entropy);
}

TEST_F(PreparedData, BlocksAreTheTokenFileInOrderWithOnlyTheTailDropped) {
  const TokenDataset ds = TokenDataset::open(data());
  const std::vector<uint16_t> file = decode_u16(test::read_text(data() + "/tokens.bin"));
  ASSERT_EQ(static_cast<int64_t>(file.size()), ds.num_tokens());
  const int64_t n = ds.num_blocks();
  // group_texts: concatenate, cut into blocks, drop less than one block at the end.
  EXPECT_LT(ds.num_tokens() - n * kBlock, kBlock);
  EXPECT_GE(ds.num_tokens() - n * kBlock, 0);

  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  const torch::Tensor blocks = ds.blocks(order).reshape({-1}).contiguous();
  ASSERT_EQ(blocks.numel(), n * kBlock);
  const int64_t* got = blocks.data_ptr<int64_t>();
  int64_t mismatches = 0, first_mismatch = -1;
  for (int64_t i = 0; i < n * kBlock; ++i)
    if (got[i] != file[static_cast<size_t>(i)] && mismatches++ == 0) first_mismatch = i;
  EXPECT_EQ(mismatches, 0) << "first at token " << first_mismatch;

  // The index marks where each document starts, and each starts with <s>.
  const Json manifest = read_json_file(data() + "/manifest.json");
  const std::vector<uint64_t> index = decode_u64(test::read_text(data() + "/index.bin"));
  ASSERT_EQ(static_cast<int64_t>(index.size()), manifest["documents"].get<int64_t>() + 1);
  EXPECT_EQ(index.front(), 0u);
  EXPECT_EQ(index.back(), file.size());
  for (size_t d = 0; d + 1 < index.size(); ++d) {
    ASSERT_LT(index[d], index[d + 1]) << "document " << d << " is empty or out of order";
    ASSERT_EQ(file[index[d]], 1) << "document " << d << " does not start with <s>";
  }
}

TEST_F(PreparedData, PreparingTwiceGivesTheSameBytes) {
  const test::TempDir again;
  const Command r = run_moeplan(prepare_args(fortune_files(), again.file("data"), kVocab, kBlock));
  ASSERT_EQ(r.exit_code, 0) << show(r);
  for (const char* name : {"tokenizer.model", "tokens.bin", "index.bin"}) {
    const std::string a = test::read_text(data() + "/" + name), b = test::read_text(again.file("data") + "/" + name);
    ASSERT_FALSE(a.empty()) << name;
    EXPECT_TRUE(a == b) << name << " differs between two preparations of the same text (" << a.size() << " vs "
                        << b.size() << " bytes)";
  }
}

TEST_F(PreparedData, TruncatedTokenFileIsAnError) {
  const test::TempDir tmp;
  const std::string dir = copy_of_data(tmp);
  const std::string tokens = dir + "/tokens.bin";
  fs::resize_file(tokens, fs::file_size(tokens) - 3);
  const std::string error = open_error(dir);
  EXPECT_TRUE(contains(error, tokens)) << error;
  EXPECT_TRUE(contains(error, "truncated")) << error;
}

TEST_F(PreparedData, ChangedTokenFailsTheChecksum) {
  const test::TempDir tmp;
  const std::string dir = copy_of_data(tmp);
  std::string bytes = test::read_text(dir + "/tokens.bin");
  // Token 100 becomes another id that is still in the vocabulary: only the CRC can tell.
  bytes[200] = static_cast<char>(bytes[200] ^ 0x01);
  write_bytes(dir + "/tokens.bin", bytes);
  const std::string error = open_error(dir);
  EXPECT_TRUE(contains(error, dir + "/tokens.bin")) << error;
  EXPECT_TRUE(contains(error, "checksum")) << error;
}

TEST_F(PreparedData, IndexThatDoesNotEndAtTheTokenCountIsAnError) {
  const test::TempDir tmp;
  const std::string dir = copy_of_data(tmp);
  std::vector<uint64_t> index = decode_u64(test::read_text(dir + "/index.bin"));
  index.back() -= 1;
  replace_with_valid_checksum(dir, "index.bin", encode_u64(index));
  const std::string error = open_error(dir);
  EXPECT_TRUE(contains(error, dir + "/index.bin")) << error;
  EXPECT_TRUE(contains(error, "does not match tokens.bin")) << error;
}

TEST_F(PreparedData, IndexOutOfOrderIsAnError) {
  const test::TempDir tmp;
  const std::string dir = copy_of_data(tmp);
  std::vector<uint64_t> index = decode_u64(test::read_text(dir + "/index.bin"));
  ASSERT_GT(index.size(), 4u);
  std::swap(index[2], index[3]);
  replace_with_valid_checksum(dir, "index.bin", encode_u64(index));
  const std::string error = open_error(dir);
  EXPECT_TRUE(contains(error, dir + "/index.bin")) << error;
  EXPECT_TRUE(contains(error, "document 3 starts before document 2")) << error;
}

TEST_F(PreparedData, TokenOutsideTheVocabularyIsAnError) {
  const test::TempDir tmp;
  const std::string dir = copy_of_data(tmp);
  std::string bytes = test::read_text(dir + "/tokens.bin");
  bytes[2 * 5] = static_cast<char>(kVocab & 0xFF);  // token 5 becomes 512, one past the last id
  bytes[2 * 5 + 1] = static_cast<char>(kVocab >> 8);
  replace_with_valid_checksum(dir, "tokens.bin", bytes);
  const std::string error = open_error(dir);
  EXPECT_TRUE(contains(error, dir + "/tokens.bin")) << error;
  EXPECT_TRUE(contains(error, "token 5 is 512, outside the vocabulary of 512")) << error;
}

TEST_F(PreparedData, MissingManifestIsAnError) {
  const test::TempDir tmp;
  const std::string dir = copy_of_data(tmp);
  fs::remove(dir + "/manifest.json");
  const std::string error = open_error(dir);
  EXPECT_TRUE(contains(error, dir)) << error;
  EXPECT_TRUE(contains(error, "no manifest.json")) << error;
}

TEST_F(PreparedData, ManifestFieldOfTheWrongTypeIsAnError) {
  struct Case {
    std::string field;  // as the error names it
    std::function<void(Json&)> change;
  };
  const std::vector<Case> cases = {
      {"block_size", [](Json& m) { m["block_size"] = std::to_string(kBlock); }},
      {"vocab_size", [](Json& m) { m["vocab_size"] = 512.5; }},
      {"files.tokens.bin.crc32", [](Json& m) { m["files"]["tokens.bin"]["crc32"] = "0"; }},
      {"files", [](Json& m) { m["files"] = Json::array(); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    const test::TempDir tmp;
    const std::string dir = copy_of_data(tmp);
    Json manifest = read_json_file(dir + "/manifest.json");
    c.change(manifest);
    write_bytes(dir + "/manifest.json", manifest.dump(2));
    const std::string error = open_error(dir);
    EXPECT_TRUE(contains(error, dir + "/manifest.json: " + c.field)) << error;
  }
}

TEST_F(PreparedData, ManifestThatIsNotJsonIsAnError) {
  const test::TempDir tmp;
  const std::string dir = copy_of_data(tmp);
  const std::string manifest = test::read_text(dir + "/manifest.json");
  write_bytes(dir + "/manifest.json", manifest.substr(0, manifest.size() / 2));  // cut by a crash
  const std::string error = open_error(dir);
  EXPECT_TRUE(contains(error, dir + "/manifest.json: ")) << error;
}

// ---- `moeplan data prepare` and `moeplan run` with bad options: exit 2 and a message.

TEST_F(PreparedData, PrepareWithAMissingInputFileFails) {
  const test::TempDir tmp;
  const std::string missing = tmp.file("no-such-file.txt");
  const Command r = run_moeplan(prepare_args({missing}, tmp.file("out"), kVocab, kBlock));
  EXPECT_EQ(r.exit_code, 2) << show(r);
  // Reported by the command-line parser, before any work.
  EXPECT_TRUE(contains(r.err, "--input")) << show(r);
  EXPECT_TRUE(contains(r.err, missing)) << show(r);
  EXPECT_FALSE(fs::exists(tmp.file("out") + "/manifest.json"));
}

TEST_F(PreparedData, PrepareWithATokenizerThatIsNotSentencePieceFails) {
  const test::TempDir tmp;
  const std::string text = tmp.write("tokenizer.model", "This is a text file, not a SentencePiece model.\n");
  const Command r = run_moeplan("data prepare --input " + fortune_files()[0] + " --out " + tmp.file("out") +
                                " --tokenizer " + text + " --block-size 64 --document-separator %");
  EXPECT_EQ(r.exit_code, 2) << show(r);
  EXPECT_TRUE(contains(r.err, "moeplan: error: --tokenizer")) << show(r);
  EXPECT_TRUE(contains(r.err, text)) << show(r);
  EXPECT_FALSE(fs::exists(tmp.file("out") + "/manifest.json"));
}

TEST_F(PreparedData, PrepareWithAnEmptyTokenizerFileFails) {
  // An empty file is a valid empty protobuf message: only SentencePiece's own checks can reject it.
  const test::TempDir tmp;
  const std::string empty = tmp.write("tokenizer.model", "");
  const Command r = run_moeplan("data prepare --input " + fortune_files()[0] + " --out " + tmp.file("out") +
                                " --tokenizer " + empty + " --block-size 64 --document-separator %");
  EXPECT_EQ(r.exit_code, 2) << show(r);
  EXPECT_TRUE(contains(r.err, "moeplan: error: --tokenizer")) << show(r);
  EXPECT_FALSE(fs::exists(tmp.file("out") + "/manifest.json"));
}

TEST_F(PreparedData, PrepareWithATokenizerOfAnotherVocabularySizeFails) {
  const test::TempDir tmp;
  const Command r = run_moeplan("data prepare --input " + fortune_files()[0] + " --out " + tmp.file("out") +
                                " --tokenizer " + data() + "/tokenizer.model --vocab-size 1000 --block-size 64" +
                                " --document-separator %");
  EXPECT_EQ(r.exit_code, 2) << show(r);
  EXPECT_TRUE(contains(r.err, "moeplan: error: --vocab-size")) << show(r);
  EXPECT_TRUE(contains(r.err, "1000 does not match the tokenizer's 512 pieces")) << show(r);
  EXPECT_FALSE(fs::exists(tmp.file("out") + "/manifest.json"));

  // The same tokenizer with its own size (or none) is accepted and encodes the text the same way.
  const Command ok = run_moeplan("data prepare --input " + fortune_files()[0] + " --out " + tmp.file("ok") +
                                 " --tokenizer " + data() + "/tokenizer.model --vocab-size 512 --block-size 64" +
                                 " --document-separator %");
  ASSERT_EQ(ok.exit_code, 0) << show(ok);
  const std::string all = test::read_text(data() + "/tokens.bin"), first = test::read_text(tmp.file("ok/tokens.bin"));
  ASSERT_FALSE(first.empty());
  EXPECT_TRUE(all.compare(0, first.size(), first) == 0)
      << "the first input file's tokens differ when encoded with the saved tokenizer";
}

TEST_F(PreparedData, PrepareWithABlockLongerThanTheCorpusFails) {
  const test::TempDir tmp;
  const std::string input = tmp.write("short.txt", "A short document.\n%\nAnd another one.\n");
  const Command r = run_moeplan("data prepare --input " + input + " --out " + tmp.file("out") + " --tokenizer " +
                                data() + "/tokenizer.model --block-size 4096 --document-separator %");
  EXPECT_EQ(r.exit_code, 2) << show(r);
  EXPECT_TRUE(contains(r.err, "moeplan: error: --block-size: 4096 is longer than the whole corpus")) << show(r);
  // The folder must not look prepared: TokenDataset::open refuses it.
  EXPECT_FALSE(fs::exists(tmp.file("out") + "/manifest.json"));
  EXPECT_TRUE(contains(open_error(tmp.file("out")), "no manifest.json"));
}

// Plans `model` for one CPU rank on blocks of the prepared data (4 sequences per step, 2 per
// micro-batch), with the search's rules for any framework rather than for the executor, and runs
// one step of it into tmp/run, which must fail as bad input: the run's error output.
std::string run_refused(const test::TempDir& tmp, const std::string& model, const std::string& data,
                        const std::string& layout = "--gpus 1") {
  const std::string plan = tmp.file("plan.json");
  const Command made = run_moeplan("search --target any " + layout + " --instance local-cpu --model " + model +
                                   " --seq-len " + std::to_string(kBlock) + " --global-batch-tokens " +
                                   std::to_string(4 * kBlock) + " --precision fp32 --max-micro-batch 2 --out " + plan);
  EXPECT_EQ(made.exit_code, 0) << show(made);
  const std::string out = tmp.file("run");
  const Command r = run_moeplan("run " + plan + " --data " + data + " --out " + out + " --steps 1 --threads 1");
  EXPECT_EQ(r.exit_code, 2) << show(r);
  EXPECT_FALSE(fs::exists(out + "/metrics.jsonl"));
  return r.err;
}

TEST_F(PreparedData, RunWithAModelOfAnotherVocabularyFails) {
  // mixtral-tiny has 4096 pieces; the data has 512.
  const std::string err = run_refused(test::TempDir(), "mixtral-tiny", data());
  EXPECT_TRUE(contains(err, "moeplan: error: run: model.vocab_size: 4096 does not match the tokenizer of " + data()))
      << err;
}

TEST_F(PreparedData, RunOfADenseModelIsRefusedNamingTheField) {
  const test::TempDir tmp;
  // mixtral-tiny with one expert: a dense model, planned like any other.
  Json model = read_json_file(test::profile_path("models/mixtral-tiny.json"));
  model["name"] = "dense-tiny";
  model["vocab_size"] = kVocab;
  model["num_experts"] = 1;
  model["experts_per_token"] = 1;
  const std::string err = run_refused(tmp, tmp.write("dense-tiny.json", model.dump()), data());
  EXPECT_TRUE(contains(err, "moeplan: error: run: model.num_experts: = 1 (a dense model): the executor trains "
                            "Mixture-of-Experts models"))
      << err;
}

// What the executor does not train is refused before any rank starts, naming the field: a
// vocabulary that T does not divide (the embedding and lm head are split over it), and, with
// pipeline stages, router losses in the objective or offloading.
TEST_F(PreparedData, RunOfAnUnevenVocabularySplitOrUntrainedPipelineLossIsRefusedNamingTheField) {
  const test::TempDir tmp;
  Json model = read_json_file(test::profile_path("models/mixtral-tiny.json"));
  model["vocab_size"] = kVocab + 1;
  const std::string odd = tmp.write("tiny-odd.json", model.dump());
  const std::string tensor = run_refused(
      tmp, odd, data(), "--gpus 2 --tensor-parallel-degree 2 --sequence-parallel on --pipeline-parallel-degree 1");
  EXPECT_TRUE(contains(tensor, "model.vocab_size: = 513 is not divisible by tensor_parallel_degree = 2")) << tensor;

  model["vocab_size"] = kVocab;
  const std::string file = tmp.write("tiny.json", model.dump());
  const Command made = run_moeplan("search --gpus 2 --instance local-cpu --model " + file + " --seq-len " +
                                   std::to_string(kBlock) + " --global-batch-tokens " + std::to_string(4 * kBlock) +
                                   " --precision fp32 --tensor-parallel-degree 1 --pipeline-parallel-degree 2 --out " +
                                   tmp.file("p2.json"));
  ASSERT_EQ(made.exit_code, 0) << show(made);
  Json plan = read_json_file(tmp.file("p2.json"));
  plan["moe"]["load_balancing"] = "aux_loss";
  plan["moe"]["z_loss_coef"] = 0.001;
  const Command r = run_moeplan("run " + tmp.write("p2-aux.json", plan.dump()) + " --data " + data() + " --out " +
                                tmp.file("run") + " --steps 1");
  EXPECT_EQ(r.exit_code, 2) << show(r);
  EXPECT_TRUE(contains(r.err, "moe.load_balancing: = \"aux_loss\" with pipeline_parallel_degree = 2")) << r.err;
  EXPECT_TRUE(contains(r.err, "moe.z_loss_coef: = 0.001")) << r.err;
  EXPECT_FALSE(fs::exists(tmp.file("run") + "/metrics.jsonl"));
}

// A plan may name its data (`search --data`): `run` then needs no --data, and the run folder
// holds the plan, its simulated step and the measured one, of the same plan, for `moeplan view
// run/`. A plan without data, run without --data, says how to prepare some.
TEST_F(PreparedData, APlanNamesItsDataAndTheRunFolderHoldsBothSteps) {
  const test::TempDir tmp;
  Json model = read_json_file(test::profile_path("models/mixtral-tiny.json"));
  model["vocab_size"] = kVocab;
  const std::string file = tmp.write("tiny.json", model.dump());
  const std::string search = "search --gpus 1 --instance local-cpu --model " + file + " --seq-len " +
                             std::to_string(kBlock) + " --global-batch-tokens " + std::to_string(4 * kBlock) +
                             " --precision fp32 --max-micro-batch 2";
  const Command made = run_moeplan(search + " --data " + data() + " --out " + tmp.file("plan.json"));
  ASSERT_EQ(made.exit_code, 0) << show(made);
  EXPECT_EQ(read_plan_file(tmp.file("plan.json")).training.data, data());
  const Command r = run_moeplan("run " + tmp.file("plan.json") + " --out " + tmp.file("run") + " --steps 1 --threads 1");
  ASSERT_EQ(r.exit_code, 0) << show(r);
  EXPECT_TRUE(contains(r.out, "moeplan view " + tmp.file("run"))) << r.out;
  EXPECT_EQ(read_plan_file(tmp.file("run/plan.json")), read_plan_file(tmp.file("plan.json")));
  const Trace simulated = read_trace_file(tmp.file("run/simulated.json"));
  const Trace measured = read_trace_file(tmp.file("run/trace.json"));
  EXPECT_EQ(simulated.source, "simulated");
  EXPECT_EQ(measured.source, "measured");
  EXPECT_FALSE(measured.plan.empty());
  EXPECT_EQ(simulated.plan, measured.plan);
  EXPECT_EQ(simulated.world_size, 1);

  const Command bare = run_moeplan(search + " --out " + tmp.file("bare.json"));
  ASSERT_EQ(bare.exit_code, 0) << show(bare);
  const Command refused = run_moeplan("run " + tmp.file("bare.json") + " --out " + tmp.file("run2") + " --steps 1");
  EXPECT_EQ(refused.exit_code, 2) << show(refused);
  EXPECT_TRUE(contains(refused.err, "--data: " + tmp.file("bare.json") + " names no training data")) << refused.err;
  EXPECT_TRUE(contains(refused.err, "moeplan data prepare")) << refused.err;
  const Command rehearsal =
      run_moeplan("run " + tmp.file("bare.json") + " --rehearse --out " + tmp.file("rehearsal") + " --steps 2");
  EXPECT_EQ(rehearsal.exit_code, 2) << show(rehearsal);
  EXPECT_TRUE(contains(rehearsal.err, "--data: " + tmp.file("bare.json") + " names no training data")) << rehearsal.err;
  const Command missing = run_moeplan(search + " --data " + tmp.file("nowhere") + " --out " + tmp.file("x.json"));
  EXPECT_EQ(missing.exit_code, 2) << show(missing);
  EXPECT_TRUE(contains(missing.err, "--data: " + tmp.file("nowhere") + " has no manifest.json")) << missing.err;
}

// Every plan the search writes for `moeplan run` (its default target) is one the executor
// trains: all of the search's valid candidates for small Mixtral models on 1 to 8 local ranks,
// with and without router losses in the objective, pass the executor's own check of a plan
// against its data. A search for Megatron-Core's layouts does write plans the executor refuses
// (the distributed optimizer), so the check has something to catch.
TEST_F(PreparedData, EveryPlanTheSearchWritesForTheExecutorIsOneItRuns) {
  const TokenDataset ds = TokenDataset::open(data());
  ModelSpec tiny = test::model("mixtral-tiny");
  tiny.vocab_size = kVocab;
  RunOptions run;
  run.stop_after_step = 1;
  auto refused = [&](int64_t gpus, const MoeConfig& moe, Precision precision, bool executor_mode, int64_t& checked) {
    planner::SearchOptions o = test::search_options(gpus, kBlock);
    o.training.global_batch_tokens = 16 * kBlock;
    o.training.precision = precision;
    o.moe = moe;
    o.max_micro_batch = 4;
    o.estimator = planner::Estimator::kAnalytic;  // ranks every candidate that fits
    o.ignore_memory_limits = true;
    o.keep = size_t{1} << 20;
    o.target = executor_mode ? planner::executor_target() : nullptr;
    const ClusterSpec cluster = test::hardware("local-cpu", gpus);
    const planner::SearchResult result = planner::search(tiny, cluster, o);
    int64_t refusals = 0;
    for (const planner::Candidate& c : result.ranked) {
      Plan plan;
      plan.model = tiny;
      plan.cluster = cluster;
      plan.moe = o.moe;
      plan.training = o.training;
      plan.parallel = c.parallel;
      Diagnostics d;
      check_run_inputs(plan, ds, run, d);
      ++checked;
      if (!d.empty()) {
        ++refusals;
        if (executor_mode)
          for (const Diagnostic& each : d.items()) ADD_FAILURE() << describe(c.parallel) << ": " << each.path << " " << each.message;
      }
    }
    EXPECT_LT(result.ranked.size(), o.keep) << "every valid candidate is walked";
    return refusals;
  };
  MoeConfig losses;
  losses.load_balancing = LoadBalancing::kAuxLoss;
  losses.aux_loss_coef = 0.01;
  losses.z_loss_coef = 0.001;
  int64_t checked = 0;
  for (int64_t gpus : {1, 2, 4, 8})
    for (const MoeConfig& moe : {MoeConfig{}, losses})
      for (Precision precision : {Precision::kFp32, Precision::kMixed})
        EXPECT_EQ(refused(gpus, moe, precision, true, checked), 0) << gpus << " ranks";
  EXPECT_GT(checked, 1000);  // tensor, pipeline, expert and shard degrees, checkpointing, offloading

  int64_t megatron_checked = 0;
  EXPECT_GT(refused(4, MoeConfig{}, Precision::kMixed, false, megatron_checked), 0);
}

}  // namespace
}  // namespace moeplan::executor
