#include "moeplan/executor/io/tokens.h"

#include "moeplan/executor/io/data_prepare.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/plan.h"

namespace moeplan::executor {
namespace fs = std::filesystem;

TokenDataset TokenDataset::open(const std::string& dir) {
  const std::string manifest_path = dir + "/manifest.json";
  if (!fs::exists(manifest_path))
    throw InputError(dir, {{"", "no manifest.json: not a prepared data folder (or its preparation did not finish)"}});
  const Json json = read_json_file(manifest_path);
  Diagnostics d;
  TokenDataset ds;
  ds.dir_ = dir;
  struct FileCheck {
    int64_t bytes = 0;
    uint32_t crc = 0;
  };
  FileCheck tokens_file, index_file;
  int64_t documents = 0;
  {
    ObjectReader r(json, "", d);
    if (r.ok()) {
      if (r.integer("schema_version", 1, 1000) != kTokensSchemaVersion)
        d.error("schema_version", "this moeplan reads version " + std::to_string(kTokensSchemaVersion));
      if (r.string("kind") != "moeplan-tokens") d.error("kind", "expected \"moeplan-tokens\"");
      ds.vocab_size_ = r.integer("vocab_size", 1, int64_t{1} << 31);
      ds.block_size_ = r.integer("block_size", 2, int64_t{1} << 24);
      ds.token_bytes_ = r.integer("token_bytes", 2, 4);
      ds.num_tokens_ = r.integer("tokens", 1, int64_t{1} << 50);
      ds.num_blocks_ = r.integer("blocks", 1, int64_t{1} << 50);
      documents = r.integer("documents", 1, int64_t{1} << 50);
      ds.unigram_entropy_nats_ = r.number("unigram_entropy_nats", 0, 1e3);
      r.ignore("tokenizer");
      r.ignore("inputs");
      if (auto files = r.object("files")) {
        for (auto [name, check] : {std::pair{"tokens.bin", &tokens_file}, std::pair{"index.bin", &index_file}}) {
          if (auto f = files->object(name)) {
            check->bytes = f->integer("bytes", 0, int64_t{1} << 52);
            check->crc = static_cast<uint32_t>(f->integer("crc32", 0, 0xFFFFFFFFll));
            f->finish();
          }
        }
        files->finish();
      }
      r.finish();
    }
  }
  d.throw_if_any(manifest_path);
  if (ds.token_bytes_ == 3) d.error("token_bytes", "must be 2 or 4");
  if (ds.num_blocks_ != ds.num_tokens_ / ds.block_size_)
    d.error("blocks", std::to_string(ds.num_blocks_) + " is not tokens / block_size = " +
                          std::to_string(ds.num_tokens_ / ds.block_size_));
  if (tokens_file.bytes != ds.num_tokens_ * ds.token_bytes_)
    d.error("files.tokens.bin.bytes", "does not equal tokens x token_bytes");
  if (index_file.bytes != (documents + 1) * 8) d.error("files.index.bin.bytes", "does not equal (documents + 1) x 8");
  d.throw_if_any(manifest_path);

  for (auto [name, check] : {std::pair{"tokens.bin", &tokens_file}, std::pair{"index.bin", &index_file}}) {
    const std::string path = dir + "/" + name;
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (ec) throw InputError(path, {{"", "missing: " + ec.message()}});
    if (static_cast<int64_t>(size) != check->bytes)
      throw InputError(path, {{"", std::to_string(size) + " bytes, the manifest says " + std::to_string(check->bytes) +
                                       " (truncated or replaced)"}});
    if (crc32_file(path) != check->crc)
      throw InputError(path, {{"", "checksum does not match the manifest (the file is damaged or was changed)"}});
  }

  // The index must describe the token file: monotone offsets from 0 to the token count.
  {
    std::ifstream in(dir + "/index.bin", std::ios::binary);
    std::vector<uint64_t> index(static_cast<size_t>(documents + 1));
    in.read(reinterpret_cast<char*>(index.data()), static_cast<std::streamsize>(index.size() * 8));
    if (index.front() != 0 || index.back() != static_cast<uint64_t>(ds.num_tokens_))
      throw InputError(dir + "/index.bin", {{"", "does not match tokens.bin: offsets run from " +
                                                     std::to_string(index.front()) + " to " +
                                                     std::to_string(index.back()) + ", the token file holds " +
                                                     std::to_string(ds.num_tokens_) + " tokens"}});
    for (size_t i = 1; i < index.size(); ++i)
      if (index[i] < index[i - 1])
        throw InputError(dir + "/index.bin", {{"", "document " + std::to_string(i) + " starts before document " +
                                                       std::to_string(i - 1)}});
  }

  const std::string tokens_path = dir + "/tokens.bin";
  const int fd = ::open(tokens_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(tokens_path, {{"", std::string("cannot open: ") + std::strerror(errno)}});
  ds.mapped_bytes_ = static_cast<size_t>(tokens_file.bytes);
  void* p = ::mmap(nullptr, ds.mapped_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw InputError(tokens_path, {{"", std::string("cannot map: ") + std::strerror(errno)}});
  ds.data_ = static_cast<const unsigned char*>(p);
  for (int64_t i = 0; i < ds.num_tokens_; ++i) {
    uint32_t v = 0;
    for (int64_t b = 0; b < ds.token_bytes_; ++b) v |= static_cast<uint32_t>(ds.data_[i * ds.token_bytes_ + b]) << (8 * b);
    if (v >= static_cast<uint32_t>(ds.vocab_size_))
      throw InputError(tokens_path, {{"", "token " + std::to_string(i) + " is " + std::to_string(v) +
                                              ", outside the vocabulary of " + std::to_string(ds.vocab_size_)}});
  }
  return ds;
}

TokenDataset::~TokenDataset() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), mapped_bytes_);
}

TokenDataset::TokenDataset(TokenDataset&& o) noexcept { *this = std::move(o); }

TokenDataset& TokenDataset::operator=(TokenDataset&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), mapped_bytes_);
    dir_ = std::move(o.dir_);
    block_size_ = o.block_size_;
    num_blocks_ = o.num_blocks_;
    vocab_size_ = o.vocab_size_;
    num_tokens_ = o.num_tokens_;
    token_bytes_ = o.token_bytes_;
    unigram_entropy_nats_ = o.unigram_entropy_nats_;
    data_ = std::exchange(o.data_, nullptr);
    mapped_bytes_ = std::exchange(o.mapped_bytes_, 0);
  }
  return *this;
}

torch::Tensor TokenDataset::blocks(const std::vector<int64_t>& indices) const {
  torch::Tensor out = torch::empty({static_cast<int64_t>(indices.size()), block_size_}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (const int64_t block : indices) {
    if (block < 0 || block >= num_blocks_) throw std::out_of_range("block " + std::to_string(block));
    const unsigned char* p = data_ + block * block_size_ * token_bytes_;
    for (int64_t i = 0; i < block_size_; ++i, p += token_bytes_) {
      uint32_t v = 0;
      for (int64_t b = 0; b < token_bytes_; ++b) v |= static_cast<uint32_t>(p[b]) << (8 * b);
      *o++ = v;
    }
  }
  return out;
}

int64_t BlockOrder::block_of(int64_t sample) {
  const int64_t epoch = sample / num_blocks_;
  if (epoch != epoch_) {
    permutation_.resize(static_cast<size_t>(num_blocks_));
    for (int64_t i = 0; i < num_blocks_; ++i) permutation_[static_cast<size_t>(i)] = i;
    // Fisher-Yates with splitmix64, written out so the order is the same with every standard
    // library.
    uint64_t state = seed_ ^ (0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(epoch + 1));
    auto next = [&state] {
      uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      return z ^ (z >> 31);
    };
    for (int64_t i = num_blocks_ - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(next() % static_cast<uint64_t>(i + 1));
      std::swap(permutation_[static_cast<size_t>(i)], permutation_[static_cast<size_t>(j)]);
    }
    epoch_ = epoch;
  }
  return permutation_[static_cast<size_t>(sample % num_blocks_)];
}

}  // namespace moeplan::executor
