#include "moeplan/core/json_reader.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace moeplan {

int64_t json_nesting_depth(std::string_view text) {
  int64_t depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character, a quote included, does not end the string
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

Json parse_json_text(std::string_view text, const std::string& origin) {
  // The depth is measured before parsing, not by a parser callback: with a callback, nlohmann
  // looks through the enclosing container at the end of every object for values to drop, so an
  // array of n objects costs n^2 (a 16-rank step trace took 100 s under AddressSanitizer).
  if (json_nesting_depth(text) > kMaxJsonDepth)
    throw InputError(origin, {{"", "nested deeper than " + std::to_string(kMaxJsonDepth) + " levels"}});
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    // nlohmann's message is "[json.exception.parse_error.101] parse error at line 1, column 5:
    // syntax error ..." (or out_of_range.406 for a number beyond a double); keep the part after
    // the tag.
    std::string what = e.what();
    if (auto pos = what.find("] "); pos != std::string::npos) what = what.substr(pos + 2);
    throw InputError(origin, {{"", "not valid JSON (" + what + ")"}});
  }
}

Json read_json_file(const std::string& path) {
  // An ifstream opens a folder and reads nothing from it: say what it is.
  if (std::error_code ec; std::filesystem::is_directory(path, ec))
    throw InputError(path, {{"", "is a folder, not a JSON file"}});
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, {{"", "cannot open file"}});
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InputError(path, {{"", "cannot read file"}});
  return parse_json_text(text.str(), path);
}

std::string describe_json(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return value.get<bool>() ? "true" : "false";
    case Json::value_t::string: {
      std::string s = value.get<std::string>();
      if (s.size() > 40) s = s.substr(0, 40) + "...";
      return "string " + Json(s).dump(-1, ' ', true, Json::error_handler_t::replace);
    }
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float: return "number " + value.dump();
    case Json::value_t::object: return "an object";
    case Json::value_t::array: return "an array";
    default: return "an unsupported value";
  }
}

ObjectReader::ObjectReader(const Json& value, std::string path, Diagnostics& diagnostics,
                           SourceMap* sources)
    : path_(std::move(path)), diagnostics_(&diagnostics), sources_(sources) {
  if (value.is_object()) {
    object_ = &value;
  } else {
    diagnostics.error(path_, "expected an object, got " + describe_json(value));
  }
}

std::string ObjectReader::path_of(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

bool ObjectReader::has(std::string_view key) const {
  return object_ != nullptr && object_->contains(key);
}

void ObjectReader::error(std::string_view key, std::string message) const {
  diagnostics_->error(path_of(key), std::move(message));
}

const Json* ObjectReader::value_of(std::string_view key, bool required) {
  known_.emplace(key);
  if (object_ == nullptr) return nullptr;
  auto it = object_->find(key);
  if (it == object_->end()) {
    if (required) error(key, "missing required field");
    return nullptr;
  }
  const Json* value = &*it;
  if (sources_ != nullptr && value->is_object()) {
    // {"value": 312e12, "source": "NVIDIA A100 datasheet"}
    auto v = value->find("value");
    auto s = value->find("source");
    bool extra = false;
    for (auto field = value->begin(); field != value->end(); ++field)
      if (field.key() != "value" && field.key() != "source") extra = true;
    if (v == value->end() || s == value->end() || !s->is_string() || extra) {
      error(key, "expected a value or {\"value\": ..., \"source\": \"...\"}");
      return nullptr;
    }
    (*sources_)[path_of(key)] = s->get<std::string>();
    return &*v;
  }
  return value;
}

const Json* ObjectReader::child(std::string_view key, bool optional) {
  known_.emplace(key);
  if (object_ == nullptr) return nullptr;
  auto it = object_->find(key);
  if (it == object_->end()) {
    if (!optional) error(key, "missing required field");
    return nullptr;
  }
  return &*it;
}

void ObjectReader::ignore(std::string_view key) { known_.emplace(key); }

int64_t ObjectReader::integer(std::string_view key, int64_t min, int64_t max,
                              std::optional<int64_t> fallback) {
  const Json* value = value_of(key, !fallback.has_value());
  const int64_t neutral = fallback.value_or(min);
  if (value == nullptr) return neutral;
  auto out_of_range = [&](const std::string& got) {
    error(key, "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " + got);
    return neutral;
  };
  if (value->is_number_unsigned()) {
    uint64_t v = value->get<uint64_t>();
    if (v > static_cast<uint64_t>(max)) return out_of_range(std::to_string(v));
    auto s = static_cast<int64_t>(v);
    if (s < min) return out_of_range(std::to_string(v));
    return s;
  }
  if (value->is_number_integer()) {
    int64_t v = value->get<int64_t>();
    if (v < min || v > max) return out_of_range(std::to_string(v));
    return v;
  }
  if (value->is_number_float()) {
    double v = value->get<double>();
    if (!std::isfinite(v) || v != std::floor(v)) {
      error(key, "expected an integer, got " + describe_json(*value));
      return neutral;
    }
    // Compare in int64 once v is known to convert: 2^63 itself does not, although it equals
    // static_cast<double>(INT64_MAX).
    constexpr double kTwoTo63 = 9223372036854775808.0;
    if (v >= kTwoTo63 || v < -kTwoTo63) return out_of_range(value->dump());
    const auto iv = static_cast<int64_t>(v);
    if (iv < min || iv > max) return out_of_range(value->dump());
    return iv;
  }
  error(key, "expected an integer, got " + describe_json(*value));
  return neutral;
}

double ObjectReader::number(std::string_view key, double min, double max,
                            std::optional<double> fallback) {
  const Json* value = value_of(key, !fallback.has_value());
  const double neutral = fallback.value_or(min);
  if (value == nullptr) return neutral;
  if (!value->is_number()) {
    error(key, "expected a number, got " + describe_json(*value));
    return neutral;
  }
  double v = value->get<double>();
  if (!std::isfinite(v) || v < min || v > max) {
    std::ostringstream range;
    range << "must be in [" << min << ", " << max << "], got " << value->dump();
    error(key, range.str());
    return neutral;
  }
  return v;
}

bool ObjectReader::boolean(std::string_view key, std::optional<bool> fallback) {
  const Json* value = value_of(key, !fallback.has_value());
  if (value == nullptr) return fallback.value_or(false);
  if (!value->is_boolean()) {
    error(key, "expected true or false, got " + describe_json(*value));
    return fallback.value_or(false);
  }
  return value->get<bool>();
}

std::string ObjectReader::string(std::string_view key, std::optional<std::string> fallback) {
  const Json* value = value_of(key, !fallback.has_value());
  if (value == nullptr) return fallback.value_or("");
  if (!value->is_string()) {
    error(key, "expected a string, got " + describe_json(*value));
    return fallback.value_or("");
  }
  return value->get<std::string>();
}

std::optional<int64_t> ObjectReader::nullable_integer(std::string_view key, int64_t min,
                                                      int64_t max) {
  if (object_ != nullptr) {
    auto it = object_->find(key);
    if (it == object_->end() || it->is_null()) {
      known_.emplace(key);
      return std::nullopt;
    }
  }
  return integer(key, min, max, 0);
}

std::optional<ObjectReader> ObjectReader::object(std::string_view key, bool optional) {
  const Json* value = child(key, optional);
  if (value == nullptr) return std::nullopt;
  if (!value->is_object()) {
    error(key, "expected an object, got " + describe_json(*value));
    return std::nullopt;
  }
  return ObjectReader(*value, path_of(key), *diagnostics_, sources_);
}

void ObjectReader::finish() {
  if (object_ == nullptr) return;
  for (auto it = object_->begin(); it != object_->end(); ++it) {
    if (!known_.contains(it.key())) error(it.key(), "unknown field");
  }
}

}  // namespace moeplan
