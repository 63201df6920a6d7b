#pragma once
// Strict reading of moeplan's JSON formats: every field is type- and range-checked, unknown
// fields are errors, and each problem is reported with its field path. Reading goes on after a
// problem so that one pass reports all of them.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "moeplan/core/errors.h"

namespace moeplan {

// Objects keep their fields in document order, so what is read back writes out the same.
using Json = nlohmann::ordered_json;

// Where each hardware or model number came from, keyed by field path ("gpu.memory_bytes").
using SourceMap = std::map<std::string, std::string>;

// Deepest nesting the readers take. No moeplan file nests more than a few levels, and nlohmann
// copies, compares and prints a document recursively, one call per level: a file of a few
// hundred kilobytes of brackets ran out of stack.
inline constexpr int kMaxJsonDepth = 128;

// How deeply text nests objects and arrays (brackets inside strings do not count), in one pass;
// text that is not JSON is measured as far as it goes.
int64_t json_nesting_depth(std::string_view text);

// Parses text as JSON. A syntax error, or nesting deeper than kMaxJsonDepth, becomes an
// InputError naming origin (and the byte offset of a syntax error).
Json parse_json_text(std::string_view text, const std::string& origin);
// Reads and parses a file; a missing or unreadable file is an InputError too.
Json read_json_file(const std::string& path);

// Reads one JSON object. Each accessor marks its key as known; finish() reports the rest.
// On a problem it records a Diagnostic and returns the fallback (or a neutral value), so the
// caller keeps reading and every problem is reported.
class ObjectReader {
 public:
  ObjectReader(const Json& value, std::string path, Diagnostics& diagnostics,
               SourceMap* sources = nullptr);

  bool ok() const { return object_ != nullptr; }
  bool has(std::string_view key) const;
  std::string path_of(std::string_view key) const;

  // Integers accept JSON integers and integral floats (4.0e10) within [min, max].
  int64_t integer(std::string_view key, int64_t min, int64_t max,
                  std::optional<int64_t> fallback = std::nullopt);
  double number(std::string_view key, double min, double max,
                std::optional<double> fallback = std::nullopt);
  bool boolean(std::string_view key, std::optional<bool> fallback = std::nullopt);
  std::string string(std::string_view key, std::optional<std::string> fallback = std::nullopt);
  // Optional integer that may also be null (e.g. sliding_window).
  std::optional<int64_t> nullable_integer(std::string_view key, int64_t min, int64_t max);

  // A string that must be one of the names in `choices`.
  template <class Enum>
  Enum choice(std::string_view key, std::span<const std::pair<std::string_view, Enum>> choices,
              std::optional<Enum> fallback = std::nullopt);

  // A nested object (required unless `optional`); nullopt if absent or not an object.
  std::optional<ObjectReader> object(std::string_view key, bool optional = false);
  // Raw access to a child (marks it known); nullptr if absent. Type-checks are the caller's.
  const Json* child(std::string_view key, bool optional = false);
  // Marks a key as known without reading it.
  void ignore(std::string_view key);

  // Reports every key that no accessor asked for.
  void finish();

  Diagnostics& diagnostics() const { return *diagnostics_; }
  SourceMap* sources() const { return sources_; }

 private:
  // The value of key, unwrapping the {"value": x, "source": "..."} form when sources are kept.
  const Json* value_of(std::string_view key, bool required);
  void error(std::string_view key, std::string message) const;

  const Json* object_ = nullptr;
  std::string path_;
  Diagnostics* diagnostics_;
  SourceMap* sources_;
  std::set<std::string, std::less<>> known_;
};

// Reads the object at `path` into a default T by `fields(reader, t)`, then reports the keys
// `fields` did not ask for; a default T where the value is not an object.
template <class T, class Fields>
T read_object(const Json& json, const std::string& path, Diagnostics& d, Fields&& fields) {
  T out;
  ObjectReader r(json, path, d);
  if (!r.ok()) return out;
  fields(r, out);
  r.finish();
  return out;
}

// Short description of a JSON value for messages: `string "two"`, `number -3`, `object`.
std::string describe_json(const Json& value);

template <class Enum>
Enum ObjectReader::choice(std::string_view key,
                          std::span<const std::pair<std::string_view, Enum>> choices,
                          std::optional<Enum> fallback) {
  const Json* value = value_of(key, !fallback.has_value());
  if (value == nullptr) return fallback.value_or(choices.front().second);
  if (value->is_string()) {
    const auto& text = value->template get_ref<const std::string&>();
    for (const auto& [name, e] : choices)
      if (name == text) return e;
  }
  std::string allowed;
  for (const auto& [name, e] : choices) {
    if (!allowed.empty()) allowed += ", ";
    allowed += "\"" + std::string(name) + "\"";
  }
  error(key, "expected one of " + allowed + ", got " + describe_json(*value));
  return fallback.value_or(choices.front().second);
}

}  // namespace moeplan
