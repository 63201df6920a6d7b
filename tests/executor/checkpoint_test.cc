// Tensor files (safetensors layout) and checkpoints: exact round trips, malformed files and
// damaged or incomplete checkpoints as clear errors, and resuming through the real binary.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/executor/io/checkpoint.h"
#include "moeplan/executor/io/tensor_file.h"
#include "moeplan/executor/training/parallel_trainer.h"
#include "run_fixture.h"
#include "test_support.h"

namespace moeplan::executor {
namespace {

// A [3, 4] matrix split by columns over two tensor-parallel ranks, each block itself split over
// two shards of its flattened values: the slices put together are the matrix, and any range of
// it reads as the flattened whole; a block missing or of another width is named.
TEST(SlicedState, ColumnBlocksMakeTheWholeMatrix) {
  const torch::Tensor w = torch::arange(12, torch::kFloat).view({3, 4});
  const torch::Tensor left = w.narrow(1, 0, 2).contiguous().flatten(), right = w.narrow(1, 2, 2).contiguous().flatten();
  SlicedState state;
  state.add({{"param/o#cols0:2of4@0", left.narrow(0, 0, 4)}, {"param/o#cols0:2of4@4", left.narrow(0, 4, 2)}});
  state.add({{"param/o#cols2:4of4@0", right.narrow(0, 0, 3)}, {"param/o#cols2:4of4@3", right.narrow(0, 3, 3)}});
  Diagnostics d;
  EXPECT_TRUE(torch::equal(state.whole("param/o", {3, 4}, d), w));
  EXPECT_TRUE(torch::equal(state.range("param/o", 5, 9, d), w.flatten().narrow(0, 5, 4)));
  EXPECT_TRUE(d.items().empty());

  SlicedState missing;  // the right block never written
  missing.add({{"param/o#cols0:2of4@0", left}});
  Diagnostics m;
  EXPECT_FALSE(missing.range("param/o", 0, 2, m).defined());
  ASSERT_FALSE(m.items().empty());
  EXPECT_NE(m.items().front().message.find("columns 2..4 are in no column block"), std::string::npos)
      << m.items().front().message;

  SlicedState uneven;  // blocks whose rows differ
  uneven.add({{"param/o#cols0:2of4@0", left}, {"param/o#cols2:4of4@0", right.narrow(0, 0, 4)}});
  Diagnostics u;
  EXPECT_FALSE(uneven.whole("param/o", {3, 4}, u).defined());
  EXPECT_FALSE(u.items().empty());

  SlicedState garbled;
  EXPECT_THROW(garbled.add({{"param/o#cols2:1of4@0", left}}), InputError);
  EXPECT_THROW(garbled.add({{"param/o#cols0:2@0", left}}), InputError);
}


namespace fs = std::filesystem;

using test::kFortunesDir;

using test::contains;

using test::write_bytes;

void flip_byte(const std::string& path, uint64_t at) {
  std::string bytes = test::read_text(path);
  ASSERT_LT(at, bytes.size()) << path;
  bytes[at] = static_cast<char>(bytes[at] ^ 0x40);
  write_bytes(path, bytes);
}

using test::input_error_of;

// Same type, shape and bytes: NaN, -0.0 and denormals must survive, so no value comparison.
::testing::AssertionResult same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type())
    return ::testing::AssertionFailure() << "dtype " << a.scalar_type() << " vs " << b.scalar_type();
  if (a.sizes() != b.sizes()) return ::testing::AssertionFailure() << "shape " << a.sizes() << " vs " << b.sizes();
  const torch::Tensor ca = a.contiguous(), cb = b.contiguous();
  // An empty tensor's data pointer may be null, which memcmp must not be given even for 0 bytes.
  const size_t bytes = static_cast<size_t>(ca.numel()) * ca.element_size();
  if (bytes > 0 && std::memcmp(ca.data_ptr(), cb.data_ptr(), bytes) != 0)
    return ::testing::AssertionFailure() << "bytes differ";
  return ::testing::AssertionSuccess();
}

// ---- Tensor files

NamedTensors sample_tensors() {
  torch::Tensor f32 = torch::randn({3, 5}, torch::TensorOptions().dtype(torch::kFloat));
  f32[0][0] = std::numeric_limits<float>::quiet_NaN();
  f32[0][1] = -std::numeric_limits<float>::infinity();
  f32[0][2] = -0.0f;
  f32[0][3] = std::numeric_limits<float>::denorm_min();
  const torch::Tensor i64 = torch::tensor(std::vector<int64_t>{std::numeric_limits<int64_t>::min(), -1, 0,
                                                               (int64_t{1} << 40) + 3,
                                                               std::numeric_limits<int64_t>::max()});
  return {
      {"model.w", f32},
      {"model.b", torch::randn({7}).to(torch::kBFloat16)},
      {"ids", i64},
      {"scalar", torch::full({}, 2.5f)},
      {"empty", torch::empty({0, 7})},
      // Not contiguous: the writer must store it in logical (row-major) order.
      {"transposed", torch::arange(6, torch::kFloat).reshape({2, 3}).t()},
  };
}

TEST(TensorFile, RoundTripIsBitExact) {
  const test::TempDir tmp;
  const std::string path = tmp.file("t.safetensors");
  const NamedTensors tensors = sample_tensors();
  const uint32_t crc = write_tensor_file(path, tensors, {{"format", "pt"}});
  EXPECT_EQ(crc, crc32_file(path));

  const TensorFile file = read_tensor_file(path);
  EXPECT_EQ(file.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(file.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(file.tensors[i].first, tensors[i].first);
    EXPECT_TRUE(same_bits(file.tensors[i].second, tensors[i].second)) << tensors[i].first;
  }
  EXPECT_EQ(file.tensors[3].second.dim(), 0);
  EXPECT_EQ(file.tensors[4].second.numel(), 0);
}

TEST(TensorFile, LayoutIsSafetensors) {
  const test::TempDir tmp;
  const std::string path = tmp.file("t.safetensors");
  const NamedTensors tensors = sample_tensors();
  write_tensor_file(path, tensors, {{"format", "pt"}});
  const std::string bytes = test::read_text(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  ASSERT_LE(8 + header_bytes, bytes.size());
  EXPECT_EQ((8 + header_bytes) % 8, 0u) << "data should start 8-byte aligned";
  const Json header = Json::parse(bytes.substr(8, header_bytes));
  EXPECT_EQ(header["__metadata__"], Json({{"format", "pt"}}));
  EXPECT_EQ(header["model.w"]["dtype"], "F32");
  EXPECT_EQ(header["model.w"]["shape"], Json({3, 5}));
  EXPECT_EQ(header["model.w"]["data_offsets"], Json({0, 60}));
  EXPECT_EQ(header["model.b"]["dtype"], "BF16");
  EXPECT_EQ(header["model.b"]["data_offsets"], Json({60, 74}));
  EXPECT_EQ(header["ids"]["dtype"], "I64");
  EXPECT_EQ(header["scalar"]["shape"], Json::array());
  EXPECT_EQ(header["empty"]["shape"], Json({0, 7}));
  uint64_t data_bytes = 0;
  for (const auto& [name, t] : tensors) data_bytes += static_cast<uint64_t>(t.numel()) * t.element_size();
  EXPECT_EQ(bytes.size(), 8 + header_bytes + data_bytes);
  // The first tensor's bytes follow the header directly, little-endian float32.
  float first_finite = 0;
  std::memcpy(&first_finite, bytes.data() + 8 + header_bytes + 4 * 4, 4);
  EXPECT_EQ(first_finite, tensors[0].second[0][4].item<float>());
}

// Bytes of a tensor file: the 8-byte little-endian length (of the header unless given), the
// header, the data.
std::string tensor_file_bytes(const std::string& header, const std::string& data, uint64_t length) {
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((length >> (8 * i)) & 0xFF));
  return bytes + header + data;
}
std::string tensor_file_bytes(const std::string& header, const std::string& data) {
  return tensor_file_bytes(header, data, header.size());
}

struct MalformedCase {
  std::string name;
  std::string bytes;
  std::string expected;  // part of the message after the file's name
};

// gtest prints a failing parameter with this instead of its bytes.
void PrintTo(const MalformedCase& c, std::ostream* os) { *os << c.name; }

class MalformedTensorFile : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(MalformedTensorFile, IsAnInputErrorNamingTheFile) {
  const test::TempDir tmp;
  const std::string path = tmp.write("bad.safetensors", GetParam().bytes);
  const std::string error = input_error_of([&] { read_tensor_file(path); });
  EXPECT_TRUE(contains(error, path + ": ")) << error;
  EXPECT_TRUE(contains(error, GetParam().expected)) << error;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MalformedTensorFile,
    ::testing::Values(
        MalformedCase{"ShorterThanTheLength", std::string("\x10\0\0\0\0", 5), "truncated: 5 bytes"},
        MalformedCase{"HeaderLongerThanTheFile", tensor_file_bytes("{}", "123456", 1000),
                      "header: length 1000 does not fit in a file of 16 bytes"},
        MalformedCase{"HeaderLengthNearTwoToThe64", tensor_file_bytes("{}", "", ~uint64_t{0} - 3),
                      "header: length 18446744073709551612 does not fit"},
        MalformedCase{"HeaderNotJson", tensor_file_bytes("{\"t\": [", ""), "header: malformed JSON"},
        MalformedCase{"HeaderNotAnObject", tensor_file_bytes("[1, 2]", ""), "header: must be a JSON object"},
        MalformedCase{"MissingField", tensor_file_bytes(R"({"t": {"dtype": "F32", "shape": [1]}})", "1234"),
                      "t: needs dtype, shape and data_offsets"},
        MalformedCase{"UnknownDtype",
                      tensor_file_bytes(R"({"t": {"dtype": "F8_E9M9", "shape": [2], "data_offsets": [0, 2]}})", "12"),
                      "t.dtype: unknown dtype \"F8_E9M9\""},
        MalformedCase{"NegativeSize",
                      tensor_file_bytes(R"({"t": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}})", "12"),
                      "t.shape: must be a list of non-negative sizes"},
        MalformedCase{"OffsetsBeyondTheData",
                      tensor_file_bytes(R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                                        std::string(8, '\0')),
                      "t.data_offsets: [0, 16] outside the 8 data bytes"},
        MalformedCase{"OffsetsBackwards",
                      tensor_file_bytes(R"({"t": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}})",
                                        std::string(8, '\0')),
                      "t.data_offsets: [8, 0] outside"},
        MalformedCase{"SizeNotDtypeTimesShape",
                      tensor_file_bytes(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
                                        std::string(8, '\0')),
                      "t.data_offsets: 8 bytes, but F32 [3] needs 12"},
        MalformedCase{"Overlapping",
                      tensor_file_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                                        R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                        std::string(12, '\0')),
                      "b.data_offsets: overlaps a"},
        // 2^40 x 2^40 elements: the element count wraps to 0 in 64 bits and would then match
        // the empty byte range; it must be refused, not handed to torch::empty.
        MalformedCase{"ElementCountOverflows",
                      tensor_file_bytes(
                          R"({"t": {"dtype": "U8", "shape": [1099511627776, 1099511627776], "data_offsets": [0, 0]}})",
                          ""),
                      "t.shape"}),
    [](const ::testing::TestParamInfo<MalformedCase>& info) { return info.param.name; });

TEST(TensorFile, EmptyTensorAtTheEndOfAnotherIsNotAnOverlap) {
  // A valid file (the safetensors library orders ranges by (begin, end)): "a" ends at byte 8
  // where the empty "e" and "b" both begin. The header lists "b" before "e", as a writer that
  // sorts names or sizes may.
  const test::TempDir tmp;
  const std::string path = tmp.write(
      "t.safetensors",
      tensor_file_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                        R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},)"
                        R"( "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}})",
                        std::string(16, '\0')));
  try {
    const TensorFile file = read_tensor_file(path);
    ASSERT_EQ(file.tensors.size(), 3u);
    EXPECT_EQ(file.tensors[2].second.numel(), 0);
  } catch (const InputError& e) {
    ADD_FAILURE() << e.what();
  }
}

TEST(TensorFile, ManyTensorsWithEmptyOnesRoundTrip) {
  // Written by write_tensor_file itself: each empty tensor shares its begin offset with the next
  // tensor. Enough tensors that std::sort no longer keeps equal keys in order.
  NamedTensors tensors;
  for (int i = 0; i < 40; ++i) {
    tensors.emplace_back("w" + std::to_string(i), torch::full({3}, static_cast<float>(i)));
    tensors.emplace_back("e" + std::to_string(i), torch::empty({0}));
  }
  const test::TempDir tmp;
  const std::string path = tmp.file("t.safetensors");
  write_tensor_file(path, tensors);
  try {
    const TensorFile file = read_tensor_file(path);
    ASSERT_EQ(file.tensors.size(), tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) EXPECT_TRUE(same_bits(file.tensors[i].second, tensors[i].second));
  } catch (const InputError& e) {
    ADD_FAILURE() << e.what();
  }
}

// ---- Checkpoints through the library

NamedTensors shard_tensors(int64_t step) {
  return {{"layers.0.w", torch::full({4, 4}, static_cast<float>(step))}, {"optimizer.step", torch::full({}, step)}};
}

Json state_of(int64_t step) { return {{"samples_consumed", step * 4}, {"optimizer_step", step}}; }

// A committed checkpoint of `step` with one shard.
std::string save(const std::string& checkpoints, int64_t step) {
  const std::string dir = begin_checkpoint(checkpoints, step);
  const CheckpointFile file = write_checkpoint_shard(dir, 0, shard_tensors(step));
  commit_checkpoint(dir, step, state_of(step), {file});
  return dir;
}

TEST(Checkpoint, CommittedCheckpointOpens) {
  const test::TempDir tmp;
  const std::string checkpoints = tmp.file("checkpoints");
  const std::string dir = save(checkpoints, 5);
  EXPECT_EQ(dir, checkpoints + "/step-00000005");
  EXPECT_EQ(latest_checkpoint(checkpoints), dir);

  const LoadedCheckpoint c = open_checkpoint(dir);
  EXPECT_EQ(c.dir, dir);
  EXPECT_EQ(c.step, 5);
  EXPECT_EQ(c.state, state_of(5));
  ASSERT_EQ(c.files.size(), 1u);
  const std::string shard = dir + "/rank-00000.safetensors";
  EXPECT_EQ(c.files[0].name, "rank-00000.safetensors");
  EXPECT_EQ(c.files[0].bytes, static_cast<int64_t>(fs::file_size(shard)));
  EXPECT_EQ(c.files[0].crc32, crc32_file(shard));
  // Only the shard and the manifest: no temporary file left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2);

  const TensorFile file = read_checkpoint_shard(c, c.files[0].name);
  const NamedTensors expected = shard_tensors(5);
  ASSERT_EQ(file.tensors.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(file.tensors[i].first, expected[i].first);
    EXPECT_TRUE(same_bits(file.tensors[i].second, expected[i].second)) << expected[i].first;
  }
}

TEST(Checkpoint, FolderWithoutManifestIsIgnoredAndDoesNotOpen) {
  const test::TempDir tmp;
  const std::string checkpoints = tmp.file("checkpoints");
  const std::string dir = begin_checkpoint(checkpoints, 4);
  write_checkpoint_shard(dir, 0, shard_tensors(4));  // a save interrupted before its commit
  EXPECT_EQ(latest_checkpoint(checkpoints), "");
  const std::string error = input_error_of([&] { open_checkpoint(dir); });
  EXPECT_TRUE(contains(error, dir + ": no manifest.json")) << error;
}

TEST(Checkpoint, RewritingACommittedStepUncommitsItFirst) {
  const test::TempDir tmp;
  const std::string checkpoints = tmp.file("checkpoints");
  const std::string dir = save(checkpoints, 6);
  ASSERT_EQ(latest_checkpoint(checkpoints), dir);
  // A save of the same step begins: until it commits, the half-rewritten folder must not load.
  EXPECT_EQ(begin_checkpoint(checkpoints, 6), dir);
  EXPECT_EQ(latest_checkpoint(checkpoints), "");
  EXPECT_TRUE(contains(input_error_of([&] { open_checkpoint(dir); }), "no manifest.json"));
}

TEST(Checkpoint, ShardShorterByOneByteDoesNotOpen) {
  const test::TempDir tmp;
  const std::string dir = save(tmp.file("checkpoints"), 7);
  const std::string shard = dir + "/rank-00000.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 1);
  const std::string error = input_error_of([&] { open_checkpoint(dir); });
  EXPECT_TRUE(contains(error, shard + ": ")) << error;
  EXPECT_TRUE(contains(error, "truncated")) << error;
}

TEST(Checkpoint, ShardWithOneByteFlippedDoesNotOpen) {
  const test::TempDir tmp;
  const std::string dir = save(tmp.file("checkpoints"), 7);
  const std::string shard = dir + "/rank-00000.safetensors";
  const auto size = fs::file_size(shard);
  flip_byte(shard, size - 3);  // inside the tensor data: the file still parses, only the CRC tells
  ASSERT_EQ(fs::file_size(shard), size);
  const std::string error = input_error_of([&] { open_checkpoint(dir); });
  EXPECT_TRUE(contains(error, shard + ": checksum does not match")) << error;
}

TEST(Checkpoint, MissingShardDoesNotOpen) {
  const test::TempDir tmp;
  const std::string dir = save(tmp.file("checkpoints"), 7);
  const std::string shard = dir + "/rank-00000.safetensors";
  fs::remove(shard);
  const std::string error = input_error_of([&] { open_checkpoint(dir); });
  EXPECT_TRUE(contains(error, shard + ": listed in the manifest but missing")) << error;
}

// A manifest that names a shard outside its step's folder, where a whole copy of the shard lies
// with the size and checksum the manifest gives, does not open.
TEST(Checkpoint, ShardOutsideTheFolderDoesNotOpen) {
  const test::TempDir tmp;
  const std::string dir = save(tmp.file("checkpoints"), 7);
  fs::copy_file(dir + "/rank-00000.safetensors", tmp.file("checkpoints/rank-00000.safetensors"));
  Json manifest = read_json_file(dir + "/manifest.json");
  ASSERT_EQ(manifest["files"][0]["name"], "rank-00000.safetensors");
  manifest["files"][0]["name"] = "../rank-00000.safetensors";
  std::ofstream(dir + "/manifest.json") << manifest.dump(2);
  const std::string error = input_error_of([&] { open_checkpoint(dir); });
  EXPECT_TRUE(contains(error, "files[0].name: must be a file name inside the checkpoint folder")) << error;
}

TEST(Checkpoint, LatestIsTheHighestCommittedStep) {
  const test::TempDir tmp;
  EXPECT_EQ(latest_checkpoint(tmp.file("none")), "");  // no folder yet: nothing to resume

  const std::string a = tmp.file("a");
  save(a, 3);
  const std::string twenty = save(a, 20);
  fs::create_directories(a + "/unrelated");
  EXPECT_EQ(latest_checkpoint(a), twenty);

  // A newer step whose save did not finish loses to the older complete one.
  const std::string b = tmp.file("b");
  const std::string nine = save(b, 9);
  const std::string twelve = begin_checkpoint(b, 12);
  write_checkpoint_shard(twelve, 0, shard_tensors(12));
  EXPECT_EQ(latest_checkpoint(b), nine);
  EXPECT_EQ(open_checkpoint(latest_checkpoint(b)).step, 9);
}

TEST(Checkpoint, LatestComparesStepsAsNumbersPastEightDigits) {
  // Folder names are "step-%08lld": step 100000000 has nine digits and sorts before
  // "step-99999999" as text, although --steps allows runs that long.
  const test::TempDir tmp;
  const std::string checkpoints = tmp.file("checkpoints");
  save(checkpoints, 99999999);
  const std::string newer = save(checkpoints, 100000000);
  EXPECT_EQ(latest_checkpoint(checkpoints), newer);
}

// ---- Resuming through the real binary

using test::Command;
using test::read_metrics;
using test::run_moeplan;
using test::show;

TEST(CheckpointRun, DamagedNewestCheckpointIsAnErrorAndAnOlderOneResumes) {
  if (!fs::is_directory(kFortunesDir))
    GTEST_SKIP() << kFortunesDir << " is missing: install the Debian package fortunes";
  const test::TempDir tmp;
  constexpr int64_t kBlock = 64;
  // mixtral-tiny's 4096-piece vocabulary needs a tokenizer of that size.
  const std::string data = tmp.file("data");
  std::string inputs;
  for (const char* name : {"fortunes", "wisdom", "science"}) inputs += std::string(" ") + kFortunesDir + "/" + name;
  const Command prepared = run_moeplan("data prepare --input" + inputs + " --out " + data +
                                       " --vocab-size 4096 --block-size 64 --document-separator %");
  ASSERT_EQ(prepared.exit_code, 0) << show(prepared);
  const std::string plan = tmp.file("plan.json");
  const Command made = run_moeplan("search --gpus 1 --instance local-cpu --model mixtral-tiny --seq-len " +
                                   std::to_string(kBlock) + " --global-batch-tokens " + std::to_string(4 * kBlock) +
                                   " --precision fp32 --max-micro-batch 2 --out " + plan);
  ASSERT_EQ(made.exit_code, 0) << show(made);

  const std::string out = tmp.file("run");
  const std::string run = "run " + plan + " --data " + data + " --out " + out + " --threads 1";
  const Command first = run_moeplan(run + " --steps 2 --checkpoint-every 1");
  ASSERT_EQ(first.exit_code, 0) << show(first);
  const std::string step1 = out + "/checkpoints/step-00000001", step2 = out + "/checkpoints/step-00000002";
  ASSERT_TRUE(fs::exists(step1 + "/manifest.json"));
  ASSERT_TRUE(fs::exists(step2 + "/manifest.json"));
  const std::vector<Json> straight = read_metrics(out);
  ASSERT_EQ(straight.size(), 2u);

  // One flipped byte in the newest shard: resuming must stop, not load garbage or fall back
  // silently.
  const std::string shard = step2 + "/rank-00000.safetensors";
  flip_byte(shard, fs::file_size(shard) / 2);
  const Command damaged = run_moeplan(run + " --steps 3 --resume");
  EXPECT_EQ(damaged.exit_code, 2) << show(damaged);
  EXPECT_TRUE(contains(damaged.err, "moeplan: error: " + shard + ": checksum does not match")) << show(damaged);
  EXPECT_EQ(read_metrics(out).size(), 2u) << "a failed resume must leave metrics.jsonl alone";

  // Without its manifest the damaged step is an unfinished save: resume from step 1.
  fs::remove(step2 + "/manifest.json");
  const Command resumed = run_moeplan(run + " --steps 3 --checkpoint-every 1 --resume");
  ASSERT_EQ(resumed.exit_code, 0) << show(resumed);
  EXPECT_TRUE(contains(resumed.out, "resumed from " + step1 + " at step 1")) << show(resumed);
  const std::vector<Json> metrics = read_metrics(out);
  ASSERT_EQ(metrics.size(), 3u);
  for (size_t i = 0; i < metrics.size(); ++i) EXPECT_EQ(metrics[i]["step"], static_cast<int64_t>(i + 1));
  // Step 2 trained again from step 1's checkpoint is bitwise the step 2 of the first run.
  EXPECT_EQ(metrics[1]["loss"].get<double>(), straight[1]["loss"].get<double>());
  EXPECT_EQ(metrics[1]["grad_norm"].get<double>(), straight[1]["grad_norm"].get<double>());
  // And step 2 was saved again, whole.
  EXPECT_EQ(open_checkpoint(step2).step, 2);
}

// Found by fuzzing (fuzz/tensor_file_fuzzer.cc): a number beyond a double in the header is
// nlohmann's out_of_range, not its parse_error, and escaped the reader as such.
TEST(TensorFile, HeaderNumberBeyondADoubleIsMalformedJson) {
  const test::TempDir tmp;
  const std::string path = tmp.write(
      "t.safetensors",
      tensor_file_bytes(R"({"t": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}})", std::string(4, '\0')));
  const std::string error = input_error_of([&] { read_tensor_file(path); });
  EXPECT_TRUE(contains(error, path + ": header: malformed JSON")) << error;
}

// Found by fuzzing (fuzz/, the tensor_file and checkpoint targets): a header whose shape nests
// 30,000 arrays deep ran out of stack printing it into the error, a manifest whose state does
// copying it. Both are refused while parsing.
TEST(TensorFile, HeaderNestedTooDeepIsAnInputError) {
  const test::TempDir tmp;
  const std::string shape = std::string(30'000, '[') + std::string(30'000, ']');
  const std::string path = tmp.write(
      "t.safetensors",
      tensor_file_bytes(R"({"t": {"dtype": "F32", "shape": )" + shape + R"(, "data_offsets": [0, 4]}})", std::string(4, '\0')));
  const std::string error = input_error_of([&] { read_tensor_file(path); });
  EXPECT_TRUE(contains(error, path + ": header: nested deeper than 128 levels")) << error;
}

TEST(Checkpoint, ManifestNestedTooDeepDoesNotOpen) {
  const test::TempDir tmp;
  const std::string state = std::string(30'000, '[') + std::string(30'000, ']');
  tmp.write("manifest.json", R"({"schema_version": 1, "kind": "moeplan-checkpoint", "step": 1, "files": [], "state": )" +
                                 state + "}");
  const std::string error = input_error_of([&] { open_checkpoint(tmp.path().string()); });
  EXPECT_TRUE(contains(error, "manifest.json: nested deeper than 128 levels")) << error;
}

}  // namespace
}  // namespace moeplan::executor
