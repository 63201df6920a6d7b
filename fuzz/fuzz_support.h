#pragma once
// What the fuzz targets share: a scratch folder where a reader that takes a path finds the
// input, and the layout of an input that stands for several files (a checkpoint, a prepared
// data folder): an options byte, then the files' bytes with a separator line between them.

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "moeplan/core/model_spec.h"

namespace moeplan::fuzz {

inline constexpr std::string_view kFileSeparator = "\n--moeplan-fuzz-file--\n";

// An input that stands for the files of a folder.
struct Files {
  uint8_t options = 0;                // the first byte: what the harness does before reading
  std::vector<std::string_view> parts;  // exactly `count`; missing ones are empty
};
Files split_files(const uint8_t* data, size_t size, size_t count);
std::string join_files(uint8_t options, const std::vector<std::string>& parts);
// split_files, for a target that reads the files from Scratch: emptied of the previous
// input's files first.
Files start_folder(const uint8_t* data, size_t size, size_t count);

// The manifest of a folder with the true size and CRC-32 of each file in `files` (name ->
// bytes) where it lists that file, as a checkpoint ("files": [{"name", "bytes", "crc32"}]) or a
// prepared data folder ("files": {name: {"bytes", "crc32"}}) lists them: so that mutated data
// gets past the checksums to the checks behind them. Text that is not such a manifest is
// returned as it is.
std::string with_true_checksums(std::string_view manifest, const std::map<std::string, std::string_view>& files);
// Writes `files` (name -> bytes) to Scratch, and `manifest` beside them as manifest.json: with
// their true sizes and CRC-32s where `true_checksums`.
void write_with_manifest(std::string_view manifest, const std::map<std::string, std::string_view>& files,
                         bool true_checksums);

// The model the executor's targets read checkpoints of: Mixtral's layout at a size whose whole
// state is a few kilobytes.
const ModelSpec& tiny_model();

// A folder of this process (under $TMPDIR, else /tmp), made on first use and removed at exit.
class Scratch {
 public:
  static Scratch& get();
  const std::string& dir() const { return dir_; }
  // Removes every file the previous input left.
  void clear();
  // Writes `bytes` to dir()/name; returns the path.
  std::string write(const std::string& name, std::string_view bytes);
  std::string write(const std::string& name, const uint8_t* data, size_t size) {
    return write(name, std::string_view(reinterpret_cast<const char*>(data), size));
  }

 private:
  Scratch();
  ~Scratch();
  std::string dir_;
};

// A property every accepted input must have does not hold: says which, and aborts (a finding).
[[noreturn]] void fail(const std::string& what);

}  // namespace moeplan::fuzz
