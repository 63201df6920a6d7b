#include "fuzz_support.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "moeplan/core/checksum.h"
#include "moeplan/core/json_reader.h"

namespace moeplan::fuzz {

namespace fs = std::filesystem;

Files split_files(const uint8_t* data, size_t size, size_t count) {
  Files files;
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  if (!rest.empty()) {
    files.options = static_cast<uint8_t>(rest.front());
    rest.remove_prefix(1);
  }
  for (size_t i = 0; i < count; ++i) {
    const size_t end = i + 1 < count ? rest.find(kFileSeparator) : std::string_view::npos;
    files.parts.push_back(rest.substr(0, end));
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + kFileSeparator.size());
  }
  return files;
}

std::string join_files(uint8_t options, const std::vector<std::string>& parts) {
  std::string out(1, static_cast<char>(options));
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += kFileSeparator;
    out += parts[i];
  }
  return out;
}

Files start_folder(const uint8_t* data, size_t size, size_t count) {
  Scratch::get().clear();
  return split_files(data, size, count);
}

std::string with_true_checksums(std::string_view manifest, const std::map<std::string, std::string_view>& files) {
  Json json = Json::parse(manifest.begin(), manifest.end(), nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("files")) return std::string(manifest);
  auto put = [](Json& entry, std::string_view bytes) {
    entry["bytes"] = bytes.size();
    entry["crc32"] = crc32(bytes.data(), bytes.size());
  };
  Json& listed = json["files"];
  if (listed.is_array()) {
    for (Json& entry : listed)
      if (entry.is_object() && entry.contains("name") && entry["name"].is_string())
        if (const auto it = files.find(entry["name"].get<std::string>()); it != files.end()) put(entry, it->second);
  } else if (listed.is_object()) {
    for (const auto& [name, bytes] : files)
      if (listed.contains(name) && listed[name].is_object()) put(listed[name], bytes);
  }
  return json.dump(1, ' ', false, Json::error_handler_t::replace);
}

void write_with_manifest(std::string_view manifest, const std::map<std::string, std::string_view>& files,
                         bool true_checksums) {
  Scratch& scratch = Scratch::get();
  for (const auto& [name, bytes] : files) scratch.write(name, bytes);
  scratch.write("manifest.json", true_checksums ? with_true_checksums(manifest, files) : std::string(manifest));
}

const ModelSpec& tiny_model() {
  static const ModelSpec model = model_from_json(parse_json_text(R"({
      "schema_version": 1, "name": "mixtral-fuzz", "source": "moeplan fuzz/: Mixtral's layout, a few kilobytes",
      "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16, "num_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "num_experts": 2,
      "experts_per_token": 1, "max_position_embeddings": 64, "rope_theta": 10000.0, "sliding_window": null,
      "rms_norm_eps": 1e-05, "initializer_range": 0.02, "tie_word_embeddings": false,
      "router_aux_loss_coef": 0.001})", "tiny model"), "tiny model");
  return model;
}

Scratch& Scratch::get() {
  static Scratch scratch;
  return scratch;
}

Scratch::Scratch() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/moeplan-fuzz-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr)
    throw std::runtime_error("cannot make a scratch folder " + pattern + ": " + std::strerror(errno));
  dir_ = pattern;
}

Scratch::~Scratch() {
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

void Scratch::clear() {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) fs::remove_all(entry.path(), ec);
}

std::string Scratch::write(const std::string& name, std::string_view bytes) {
  const std::string path = dir_ + "/" + name;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  ::close(fd);
  return path;
}

void fail(const std::string& what) {
  std::fprintf(stderr, "\nmoeplan fuzz: %s\n", what.c_str());
  std::abort();
}

}  // namespace moeplan::fuzz
