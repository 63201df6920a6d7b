#include "moeplan/executor/io/tensor_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <utility>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"
#include "moeplan/core/json_reader.h"

namespace moeplan::executor {
namespace {

constexpr std::pair<const char*, torch::ScalarType> kDtypes[] = {
    {"F32", torch::kFloat},   {"BF16", torch::kBFloat16}, {"F16", torch::kHalf}, {"F64", torch::kDouble},
    {"I64", torch::kLong},    {"I32", torch::kInt},       {"I16", torch::kShort}, {"U8", torch::kByte},
    {"I8", torch::kChar},     {"BOOL", torch::kBool}};

std::optional<torch::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& [n, t] : kDtypes)
    if (name == n) return t;
  return std::nullopt;
}

// Largest header the reader accepts (safetensors itself caps it at 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw InputError(path, {{"", std::string("write failed: ") + std::strerror(errno)}});
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace

std::string safetensors_dtype(torch::ScalarType type) {
  for (const auto& [n, t] : kDtypes)
    if (t == type) return n;
  throw std::invalid_argument(std::string("no safetensors dtype for ") + c10::toString(type));
}

uint32_t write_tensor_file(const std::string& path, const NamedTensors& tensors,
                           const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  std::vector<torch::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const torch::Tensor t = tensor.detach().contiguous().cpu();
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    header[name] = {{"dtype", safetensors_dtype(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(t);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const uint64_t header_bytes = text.size();
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(header_bytes >> (8 * i));

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw InputError(path, {{"", std::string("cannot create: ") + std::strerror(errno)}});
  uint32_t crc = 0;
  try {
    write_all(fd, length, 8, path);
    crc = crc32(length, 8, crc);
    write_all(fd, text.data(), text.size(), path);
    crc = crc32(text.data(), text.size(), crc);
    for (const torch::Tensor& t : data) {
      const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      write_all(fd, t.data_ptr(), bytes, path);
      crc = crc32(t.data_ptr(), bytes, crc);
    }
    if (::fsync(fd) != 0) throw InputError(path, {{"", std::string("fsync failed: ") + std::strerror(errno)}});
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) throw InputError(path, {{"", std::string("close failed: ") + std::strerror(errno)}});
  return crc;
}

TensorFile read_tensor_file(const std::string& path, const std::set<std::string>* only) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, {{"", "cannot open the tensor file"}});
  in.seekg(0, std::ios::end);
  const uint64_t file_bytes = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (file_bytes < 8) throw InputError(path, {{"", "truncated: " + std::to_string(file_bytes) + " bytes, no header"}});
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= static_cast<uint64_t>(length[i]) << (8 * i);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_bytes - 8)
    throw InputError(path, {{"header", "length " + std::to_string(header_bytes) + " does not fit in a file of " +
                                           std::to_string(file_bytes) + " bytes"}});
  std::string text(header_bytes, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_bytes));
  if (json_nesting_depth(text) > kMaxJsonDepth)
    throw InputError(path, {{"header", "nested deeper than " + std::to_string(kMaxJsonDepth) + " levels"}});
  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::exception& e) {  // a parse error, or a number beyond a double (out_of_range.406)
    throw InputError(path, {{"header", std::string("malformed JSON: ") + e.what()}});
  }
  if (!header.is_object()) throw InputError(path, {{"header", "must be a JSON object"}});
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;

  TensorFile file;
  Diagnostics d;
  struct Entry {
    std::string name;
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) {
        d.error("__metadata__", "must be an object of strings");
        continue;
      }
      for (const auto& [k, v] : value.items()) {
        if (v.is_string()) file.metadata[k] = v.get<std::string>();
        else d.error("__metadata__." + k, "must be a string");
      }
      continue;
    }
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets")) {
      d.error(name, "needs dtype, shape and data_offsets");
      continue;
    }
    const Json& dt = value["dtype"];
    const std::optional<torch::ScalarType> dtype = dt.is_string() ? dtype_from_name(dt.get<std::string>()) : std::nullopt;
    if (!dtype) {
      d.error(name + ".dtype", "unknown dtype " + dt.dump());
      continue;
    }
    std::vector<int64_t> shape;
    bool shape_ok = value["shape"].is_array();
    uint64_t numel = 1;
    if (shape_ok) {
      for (const Json& s : value["shape"]) {
        // Sizes and their product stay below 2^50, checked before multiplying so that a
        // crafted shape cannot wrap the count around.
        if (!s.is_number_unsigned() || s.get<uint64_t>() > (uint64_t{1} << 50) ||
            __builtin_mul_overflow(numel, s.get<uint64_t>(), &numel) || numel > (uint64_t{1} << 50)) {
          shape_ok = false;
          break;
        }
        shape.push_back(s.get<int64_t>());
      }
    }
    if (!shape_ok) {
      d.error(name + ".shape", "must be a list of non-negative sizes with fewer than 2^50 elements, got " + value["shape"].dump());
      continue;
    }
    const Json& off = value["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      d.error(name + ".data_offsets", "must be [begin, end], got " + off.dump());
      continue;
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_bytes) {
      d.error(name + ".data_offsets", "[" + std::to_string(begin) + ", " + std::to_string(end) +
                                          "] outside the " + std::to_string(data_bytes) + " data bytes");
      continue;
    }
    const uint64_t expected = numel * static_cast<uint64_t>(c10::elementSize(*dtype));
    if (end - begin != expected) {
      d.error(name + ".data_offsets", std::to_string(end - begin) + " bytes, but " + dt.get<std::string>() + " " +
                                          value["shape"].dump() + " needs " + std::to_string(expected));
      continue;
    }
    entries.push_back({name, *dtype, shape, begin, end});
  }
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  // By (begin, end), so an empty tensor at the end of another sorts before the next one.
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
  });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      d.error(by_offset[i]->name + ".data_offsets", "overlaps " + by_offset[i - 1]->name);
  d.throw_if_any(path);

  for (const Entry& e : entries) {
    if (only != nullptr && only->count(e.name) == 0) continue;
    torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    in.seekg(static_cast<std::streamoff>(8 + header_bytes + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    if (!in) throw InputError(path, {{e.name, "read failed"}});
    file.tensors.emplace_back(e.name, std::move(t));
  }
  return file;
}

}  // namespace moeplan::executor
