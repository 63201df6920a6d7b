#pragma once
// Tensors on disk in the safetensors layout (8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and byte range, then the bytes), so checkpoint shards can be
// read by other tools. Reading checks every header field against the file before touching data.

#include "moeplan/executor/libtorch.h"

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace moeplan::executor {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

struct TensorFile {
  std::map<std::string, std::string> metadata;  // the header's "__metadata__"
  NamedTensors tensors;                          // in file order
};

// Writes the file (not atomically: callers write to a temporary name and rename) and fsyncs it.
// Returns the CRC-32 of the bytes written.
uint32_t write_tensor_file(const std::string& path, const NamedTensors& tensors,
                           const std::map<std::string, std::string>& metadata = {});

// Reads a whole file, or with `only` just those tensors (the header is checked whole either
// way). Throws InputError naming the file and the tensor on any inconsistency: short file,
// header length out of range, malformed JSON, unknown dtype, byte range outside the data or not
// matching dtype x shape, overlapping ranges.
TensorFile read_tensor_file(const std::string& path, const std::set<std::string>* only = nullptr);

// Safetensors dtype name ("F32", "BF16", ...) of a LibTorch type, and back.
std::string safetensors_dtype(torch::ScalarType type);

}  // namespace moeplan::executor
