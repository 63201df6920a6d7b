// Randomised robustness test of the readers: valid documents (a real plan, the shipped
// profiles, a Hugging Face config.json) are mutated at the byte level and at the JSON level,
// and every reader must either accept the result or throw moeplan::InputError. A plan that is
// accepted must also survive the memory model, the analytic step estimate and its own round
// trip. The seed is fixed, so a failure reproduces exactly.

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "moeplan/core/cluster_spec.h"
#include "moeplan/core/json_reader.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/core/plan.h"
#include "moeplan/core/routing_profile.h"
#include "moeplan/planner/memory_model.h"
#include "moeplan/planner/search.h"
#include "moeplan/simulator/analytic.h"
#include "test_support.h"

namespace moeplan {
namespace {

constexpr uint64_t kSeed = 0x6d6f65706c616e;  // "moeplan"

using test::profile_path;
using test::read_text;
using test::data_path;

// ---------------------------------------------------------------------------------------------
// Crash report. A crash cannot be caught, so the input being read is kept where a signal
// handler can print it with write(2); the handler then lets the signal kill the process.

struct CrashContext {
  const char* target = "";
  int64_t index = 0;
  const std::string* text = nullptr;  // the text being read, when the input is a text
};
CrashContext g_crash;  // written only by the fuzz loop, read only by the handler

void write_stderr(const char* s, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

extern "C" void on_crash(int sig) {
  char head[160];
  const int n = std::snprintf(head, sizeof head, "\nparser fuzz: signal %d on input #%lld (%s)%s\n", sig,
                              static_cast<long long>(g_crash.index), g_crash.target,
                              g_crash.text != nullptr ? ", text follows:" : " (a JSON-level mutation)");
  if (n > 0) write_stderr(head, static_cast<size_t>(n));
  if (g_crash.text != nullptr) {
    write_stderr(g_crash.text->data(), std::min<size_t>(g_crash.text->size(), 20000));
    write_stderr("\n", 1);
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

class CrashReport {
 public:
  CrashReport() {
    for (int sig : kSignals) previous_[index(sig)] = std::signal(sig, on_crash);
  }
  ~CrashReport() {
    for (int sig : kSignals) std::signal(sig, previous_[index(sig)]);
  }

 private:
  static constexpr int kSignals[] = {SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL};
  static size_t index(int sig) {
    for (size_t i = 0; i < std::size(kSignals); ++i)
      if (kSignals[i] == sig) return i;
    return 0;
  }
  void (*previous_[std::size(kSignals)])(int) = {};
};

// ---------------------------------------------------------------------------------------------
// Random choices

class Random {
 public:
  explicit Random(uint64_t seed) : rng_(seed) {}

  size_t below(size_t n) { return n <= 1 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < p; }
  template <class T>
  const T& pick(const std::vector<T>& items) { return items[below(items.size())]; }
  uint64_t bits() { return rng_(); }

 private:
  std::mt19937_64 rng_;
};

// Numbers at and around the limits the readers check, and past what the types hold.
std::vector<Json> extreme_numbers() {
  return {Json(0),
          Json(-0.0),
          Json(1),
          Json(-1),
          Json(2),
          Json(3),
          Json(0.5),
          Json(1.5),
          Json(0.999999),
          Json(1e300),
          Json(-1e300),
          Json(1e-300),
          Json(4.9e-324),
          Json(std::numeric_limits<double>::max()),
          Json(std::numeric_limits<double>::quiet_NaN()),
          Json(std::numeric_limits<double>::infinity()),
          Json(std::numeric_limits<int64_t>::max()),
          Json(std::numeric_limits<int64_t>::min()),
          Json(std::numeric_limits<uint64_t>::max()),
          Json(9223372036854775808.0),  // 2^63 as a double
          Json(-9223372036854775808.0),
          Json(int64_t{9007199254740993}),  // 2^53 + 1
          Json(int64_t{1} << 50),
          Json(int64_t{1} << 60),
          Json(int64_t{1} << 62),
          Json(1e15),
          Json(1e18),
          Json(1e30),
          Json(4096),
          Json(4097),
          Json(65536),
          Json(65537),
          Json(1048576),
          Json(1048577),
          Json(16777216),
          Json(16777217),
          Json(-16777216)};
}

std::vector<Json> other_values() {
  return {Json(nullptr),
          Json(true),
          Json(false),
          Json(""),
          Json("RSE"),
          Json("SER"),
          Json("RRE"),
          Json("full"),
          Json("none"),
          Json("allgather"),
          Json("mixtral"),
          Json("silu"),
          Json("1e400"),
          Json("16"),
          Json(std::string(300, 'x')),
          Json(std::string("\xc3\xa9t\xc3\xa9")),
          Json(std::string("bad \xff\xfe utf8")),
          Json::array(),
          Json::array({1, 2}),
          Json::array({Json::array({1e8, 0.5})}),
          Json::array({Json::array({1e8, 0.5}), Json::array({1e7, 0.6})}),
          Json::object(),
          Json{{"value", 8}, {"source", "fuzz"}},
          Json{{"value", "8"}, {"source", "fuzz"}},
          Json{{"value", 8}},
          Json{{"value", Json{{"value", 8}, {"source", "a"}}}, {"source", "b"}}};
}

std::vector<std::string> unknown_keys() {
  return {"foo", "expert_paralel_degree", "", "value", "source", "schema_version", "name",
          "num_nodes", "\xc3\xa9", "world_size", "a.b", "[0]"};
}

// Texts a mutation may put where a number was.
std::vector<std::string> extreme_number_texts() {
  return {"1e400", "-1e400", "1e-400", "1.7976931348623159e308", "18446744073709551616",
          "-9223372036854775809", "9223372036854775808.0", "123456789012345678901234567890",
          "0e0", "-0", "1E+308", "4.9e-324", "0.0000000000000000000000000001"};
}

// ---------------------------------------------------------------------------------------------
// JSON-level mutations

// A random value in the document, by random descent from the root; `parent` and the key or
// index are returned so the value can be removed. The root itself is returned rarely.
struct Spot {
  Json* value = nullptr;
  Json* parent = nullptr;
  std::string key;   // when parent is an object
  size_t index = 0;  // when parent is an array
  Json* nearest_object = nullptr;
};

Spot random_spot(Json& root, Random& random) {
  Spot s;
  s.value = &root;
  s.nearest_object = root.is_object() ? &root : nullptr;
  while ((s.value->is_object() || s.value->is_array()) && !s.value->empty() &&
         (s.parent == nullptr ? !random.chance(0.02) : random.chance(0.7))) {
    Json* node = s.value;
    const size_t i = random.below(node->size());
    s.parent = node;
    if (node->is_object()) {
      auto it = node->begin();
      std::advance(it, static_cast<std::ptrdiff_t>(i));
      s.key = it.key();
      s.value = &it.value();
    } else {
      s.index = i;
      s.value = &(*node)[i];
    }
    if (s.value->is_object()) s.nearest_object = s.value;
  }
  return s;
}

const Json& random_replacement(const Json& old, Random& random) {
  static const std::vector<Json> numbers = extreme_numbers();
  static const std::vector<Json> others = other_values();
  for (int attempt = 0; attempt < 8; ++attempt) {
    const Json& candidate = random.chance(0.5) ? random.pick(numbers) : random.pick(others);
    // Prefer a value of another type, or another extreme number.
    if (candidate.type() != old.type() || candidate.is_number()) return candidate;
  }
  return random.pick(others);
}

// Applies one mutation; returns a short name of what it did.
const char* mutate_json(Json& doc, Random& random) {
  Spot s = random_spot(doc, random);
  switch (random.below(6)) {
    case 0:
    case 1:
      *s.value = random_replacement(*s.value, random);
      return "replace";
    case 2: {  // remove a field or an element
      if (s.parent == nullptr) return "none";
      if (s.parent->is_object()) {
        s.parent->erase(s.key);
      } else {
        s.parent->erase(s.index);
      }
      return "remove";
    }
    case 3: {  // add an unknown field
      Json* object = s.nearest_object != nullptr ? s.nearest_object : (doc.is_object() ? &doc : nullptr);
      if (object == nullptr) return "none";
      static const std::vector<std::string> keys = unknown_keys();
      (*object)[random.pick(keys)] = random.chance(0.5) ? Json(1) : random_replacement(Json(), random);
      return "add-field";
    }
    case 4: {  // copy another part of the document here
      const Json copy = *random_spot(doc, random).value;
      *s.value = copy;
      return "copy-subtree";
    }
    default:  // nudge a number by one, across a range limit
      if (s.value->is_number_integer() || s.value->is_number_unsigned()) {
        const int64_t v = s.value->get<int64_t>();
        if (v > std::numeric_limits<int64_t>::min() && v < std::numeric_limits<int64_t>::max())
          *s.value = random.chance(0.5) ? v + 1 : v - 1;
      } else if (s.value->is_number_float()) {
        *s.value = s.value->get<double>() * (random.chance(0.5) ? -1.0 : 1e6);
      } else {
        *s.value = random_replacement(*s.value, random);
      }
      return "nudge";
  }
}

// ---------------------------------------------------------------------------------------------
// Byte-level mutations

std::vector<std::pair<size_t, size_t>> number_tokens(const std::string& text) {
  std::vector<std::pair<size_t, size_t>> tokens;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t j = i;
      while (j < text.size() && std::strchr("-+.eE0123456789", text[j]) != nullptr) ++j;
      tokens.emplace_back(i, j - i);
      i = j - 1;
    }
  }
  return tokens;
}

void mutate_text(std::string& text, Random& random) {
  static constexpr char kInteresting[] = "{}[]\",:0123456789-+.eE \n\\tfnul\x00\x7f\x80\xc3\xff";
  static const std::string interesting(kInteresting, sizeof kInteresting - 1);  // keeps the NUL
  static const std::vector<std::string> numbers = extreme_number_texts();
  if (text.empty()) {
    text = random.pick(numbers);
    return;
  }
  const size_t at = random.below(text.size());
  switch (random.below(8)) {
    case 0:  // flip one bit
      text[at] = static_cast<char>(text[at] ^ (1 << random.below(8)));
      break;
    case 1:  // set a byte to a character that matters to JSON
      text[at] = interesting[random.below(interesting.size())];
      break;
    case 2:  // truncate
      text.resize(at);
      break;
    case 3:  // delete a run of 1 to 16 characters
      text.erase(at, 1 + random.below(16));
      break;
    case 4: {  // duplicate a run of 1 to 64 characters
      const std::string run = text.substr(at, 1 + random.below(64));
      text.insert(at, run);
      break;
    }
    case 5:  // insert a character
      text.insert(at, 1, interesting[random.below(interesting.size())]);
      break;
    default: {  // replace a number with an extreme one
      const auto tokens = number_tokens(text);
      if (tokens.empty()) break;
      const auto& [pos, len] = tokens[random.below(tokens.size())];
      text.replace(pos, len, random.pick(numbers));
      break;
    }
  }
}

// Random token soup for parse_json_text alone.
std::string token_soup(Random& random) {
  static const std::vector<std::string> tokens = {
      "{", "}", "[", "]", ",", ":", " ", "\"k\"", "\"\"", "1", "-1", "0.5", "1e400", "-", "1e", "true",
      "nul", "null", "\"\\u12\"", "\"\\ud800\"", "\"\\n\"", "\xff", "\"\xc3\"", "NaN", "01", "/*", "\t"};
  std::string text;
  const size_t n = random.below(40);
  if (random.chance(0.05)) return std::string(1 + random.below(5000), '[');  // deep nesting
  for (size_t i = 0; i < n; ++i) text += random.pick(tokens);
  return text;
}

// ---------------------------------------------------------------------------------------------
// The fuzz loop

enum class Target : uint8_t { kPlan, kCluster, kModel, kHfConfig, kRouting, kJsonText };

const char* target_name(Target t) {
  switch (t) {
    case Target::kPlan: return "plan_from_json";
    case Target::kCluster: return "cluster_from_json";
    case Target::kModel: return "model_from_json";
    case Target::kHfConfig: return "model_from_hf_config";
    case Target::kRouting: return "routing_profile_from_json";
    case Target::kJsonText: return "parse_json_text";
  }
  return "?";
}

struct Document {
  Target target;
  std::string name;
  std::string text;
  Json json;
};

struct Tally {
  int64_t inputs = 0;
  int64_t accepted = 0;
};

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : random_(seed) {}

  Random& random() { return random_; }

  // Reads one input: the text when given (parsed first), otherwise the JSON. `original` is
  // the document it was made from, to show what changed when something goes wrong.
  void read(Target target, const std::string* text, const Json* json, const Document* original,
            const char* how) {
    Tally& tally = tallies_[target];
    ++tally.inputs;
    g_crash = {target_name(target), total_++, text};
    current_ = {text, json, original, how};
    Json parsed;  // outside the try: a catch block may still show it
    try {
      if (text != nullptr) {
        parsed = parse_json_text(*text, "fuzz.json");
        current_.json = &parsed;
      }
      if (accept(target, *current_.json)) ++tally.accepted;
    } catch (const InputError&) {
      // The expected way to say no.
    } catch (const std::exception& e) {
      note(target, std::string("threw a non-InputError: ") + e.what());
    } catch (...) {
      note(target, "threw something that is not a std::exception");
    }
    g_crash.text = nullptr;
  }

  int64_t total() const { return total_; }
  const std::map<Target, Tally>& tallies() const { return tallies_; }
  // Problem -> how many inputs showed it; and the first input that did.
  const std::map<std::string, int64_t>& problems() const { return problems_; }
  const std::map<std::string, std::string>& examples() const { return examples_; }

 private:
  // Returns whether the reader accepted; checks what an accepted input must satisfy.
  bool accept(Target target, const Json& json) {
    switch (target) {
      case Target::kJsonText: return true;
      case Target::kPlan: check_plan(plan_from_json(json, "fuzz.json")); return true;
      case Target::kCluster: {
        const ClusterSpec c = cluster_from_json(json, "fuzz.json");
        expect_round_trip(target, [&] { return cluster_from_json(Json(to_json(c)), "again") == c; });
        return true;
      }
      case Target::kModel: {
        const ModelSpec m = model_from_json(json, "fuzz.json");
        expect_round_trip(target, [&] { return model_from_json(Json(to_json(m)), "again") == m; });
        return true;
      }
      case Target::kHfConfig: {
        const ModelSpec m = model_from_hf_config(json, "fuzz.json");
        expect_round_trip(target, [&] { return model_from_json(Json(to_json(m)), "again") == m; });
        return true;
      }
      case Target::kRouting: {
        const RoutingProfile r = routing_profile_from_json(json, "fuzz.json");
        expect_round_trip(target, [&] { return routing_profile_from_json(routing_profile_json(r), "again") == r; });
        return true;
      }
    }
    return false;
  }

  // An accepted plan is valid by every rule, so the estimators must give sane numbers for it,
  // and what it writes must read back as the same plan.
  void check_plan(const Plan& plan) {
    const RunConfig config{plan.model, plan.cluster, plan.parallel, plan.moe, plan.training};
    const planner::MemoryEstimate memory = planner::estimate_memory(config);
    // device_total is an int64: a NaN in the double arithmetic behind it, or an overflow,
    // shows as a negative (or absurd) total.
    if (memory.device_total < 0)
      note(Target::kPlan, "estimate_memory gave a negative device_total");
    const sim::StepEstimate step = sim::estimate_step(config, sim::layout_shapes(plan.cluster, plan.parallel));
    if (!std::isfinite(step.step_time_s) || step.step_time_s <= 0 || !std::isfinite(step.tokens_per_s))
      note(Target::kPlan, "estimate_step gave a step time that is not a positive finite number");
    // One in eight goes through text, to cover number formatting; the rest stay in memory.
    const bool through_text = (random_.bits() & 7) == 0;
    expect_round_trip(
        Target::kPlan,
        [&] {
          const Json again = through_text ? parse_json_text(plan_to_text(plan), "again") : Json(to_json(plan));
          return plan_from_json(again, "again") == plan;
        });
  }

  template <class F>
  void expect_round_trip(Target target, F&& same) {
    try {
      if (!same()) note(target, "an accepted input reads back different after to_json");
    } catch (const InputError& e) {
      note(target, std::string("an accepted input is rejected after to_json: ") + e.diagnostics()[0].to_string());
    }
  }

  // Counts a problem under a key without the input's own numbers in quotes, so that one
  // cause is one entry; keeps the first input that showed it.
  void note(Target target, const std::string& problem) {
    std::string what = problem;
    if (const size_t open = what.find('\''); open != std::string::npos) {
      if (const size_t close = what.find('\'', open + 1); close != std::string::npos)
        what.replace(open, close - open + 1, "'...'");
    }
    const std::string key = std::string(target_name(target)) + ": " + what;
    if (++problems_[key] == 1) examples_[key] = show_current(problem);
  }

  // What changed: the bytes around the first difference, or a JSON patch from the original.
  std::string show_current(const std::string& problem) const {
    const Input& in = current_;
    std::string shown = "input #" + std::to_string(total_ - 1) + " (" + in.how + ", " + problem + "): ";
    if (in.text != nullptr && in.original != nullptr) {
      const std::string& a = in.original->text;
      const std::string& b = *in.text;
      size_t first = 0;
      while (first < a.size() && first < b.size() && a[first] == b[first]) ++first;
      const size_t from = first > 120 ? first - 120 : 0;
      shown += "at byte " + std::to_string(first) + " of " + in.original->name + ": " + escaped(b.substr(from, 240));
    } else if (in.text != nullptr) {
      shown += escaped(in.text->substr(0, 400));
    } else if (in.json != nullptr && in.original != nullptr) {
      shown += "patch of " + in.original->name + ": " +
               Json::diff(in.original->json, *in.json).dump(-1, ' ', false, Json::error_handler_t::replace);
    }
    if (shown.size() > 1500) shown = shown.substr(0, 1500) + "...";
    return shown;
  }

  // As a JSON string: newlines and invalid UTF-8 stay on one printable line.
  static std::string escaped(const std::string& text) {
    return Json(text).dump(-1, ' ', true, Json::error_handler_t::replace);
  }

  struct Input {
    const std::string* text = nullptr;
    const Json* json = nullptr;
    const Document* original = nullptr;
    const char* how = "";
  };

  Random random_;
  Input current_;
  int64_t total_ = 0;
  std::map<Target, Tally> tallies_;
  std::map<std::string, int64_t> problems_;
  std::map<std::string, std::string> examples_;
};

std::vector<Document> documents() {
  std::vector<Document> docs;
  auto add_file = [&](Target target, const std::string& path) {
    const std::string text = read_text(path);
    docs.push_back({target, path, text, parse_json_text(text, path)});
  };
  for (const char* name : {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge"})
    add_file(Target::kCluster, profile_path(std::string("hardware/") + name + ".json"));
  for (const char* name : {"mixtral-8x7b", "mixtral-8x22b", "mixtral-tiny"})
    add_file(Target::kModel, profile_path(std::string("models/") + name + ".json"));

  // Plans as `moeplan search` writes them: Mixtral 8x7B on two p4d nodes, and the tiny model
  // on one p5 node.
  auto add_plan = [&](const char* model_name, const char* instance, int64_t gpus) {
    const ModelSpec& model = test::model(model_name);
    const ClusterSpec cluster = test::hardware(instance, gpus);
    planner::SearchOptions options = test::search_options(gpus, std::min<int64_t>(2048, model.max_position_embeddings));
    options.moe.aux_loss_coef = model.router_aux_loss_coef;
    const planner::SearchResult result = planner::search(model, cluster, options);
    if (result.ranked.empty()) throw std::runtime_error(std::string("no plan for ") + model_name);
    const std::string text = plan_to_text(planner::make_plan(model, cluster, options, result, "fuzz"));
    docs.push_back({Target::kPlan, std::string(model_name) + " plan", text, parse_json_text(text, "plan")});
  };
  add_plan("mixtral-8x7b", "p4d.24xlarge", 16);
  add_plan("mixtral-tiny", "p5.48xlarge", 8);

  // Routing profiles of each kind, as `--routing FILE` reads them.
  const char* routing[] = {
      R"({"schema_version": 1, "kind": "balanced", "source": "balanced"})",
      R"({"schema_version": 1, "kind": "skew", "source": "Zipf", "skew": 2.5})",
      R"({"schema_version": 1, "kind": "measured", "source": "a run", "num_experts": 4, "experts_per_token": 2,
          "slots": [[[4, 2, 1, 1], [2, 2, 2, 2], [0, 0, 8, 0]], [[1, 1, 1, 5], [8, 0, 0, 0], [3, 3, 1, 1]]]})"};
  for (const char* text : routing) {
    const Json json = parse_json_text(text, "routing.json");
    docs.push_back({Target::kRouting, "routing.json", json.dump(2), json});
  }

  // mistralai/Mixtral-8x7B-v0.1 config.json, and a newer-style one with head_dim and
  // rope_scaling written out.
  const std::string published = read_text(data_path("hf/mixtral-8x7b/config.json"));
  const char* hf_configs[] = {
      published.c_str(),
      R"({"_name_or_path": "mistralai/Mixtral-8x22B-v0.1", "architectures": ["MixtralForCausalLM"],
          "hidden_act": "silu", "hidden_size": 6144, "intermediate_size": 16384, "head_dim": 128,
          "max_position_embeddings": 65536, "model_type": "mixtral", "num_attention_heads": 48,
          "num_experts_per_tok": 2, "num_hidden_layers": 56, "num_key_value_heads": 8,
          "num_local_experts": 8, "rope_scaling": null, "rope_theta": 1000000.0,
          "router_jitter_noise": 0.0, "sliding_window": null, "vocab_size": 32768,
          "dtype": "bfloat16"})"};
  for (const char* config : hf_configs) {
    const Json json = parse_json_text(config, "config.json");
    docs.push_back({Target::kHfConfig, "config.json", json.dump(2), json});
  }
  return docs;
}

// How many inputs of each kind: about 120,000 in all, sized so the whole file runs in well
// under 20 s in a RelWithDebInfo build on two cores (plans are the slow ones: 9 KB of text).
struct Budget {
  Target target;
  int64_t text_mutations;
  int64_t json_mutations;
};
constexpr Budget kBudget[] = {
    {Target::kPlan, 10'000, 30'000},
    {Target::kCluster, 8'000, 14'000},
    {Target::kModel, 8'000, 14'000},
    {Target::kHfConfig, 6'000, 14'000},
    {Target::kRouting, 1'000, 2'000},
};
constexpr int64_t kTokenSoups = 12'000;

TEST(ParserFuzz, EveryInputIsAcceptedOrAnInputError) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Document> docs = documents();
  Fuzzer fuzz(kSeed);
  Random& random = fuzz.random();
  const CrashReport crash_report;

  for (const Budget& budget : kBudget) {
    std::vector<const Document*> seeds;
    for (const Document& d : docs)
      if (d.target == budget.target) seeds.push_back(&d);
    ASSERT_FALSE(seeds.empty());

    // The unmutated documents are accepted.
    for (const Document* d : seeds) {
      const int64_t before = fuzz.tallies().count(d->target) ? fuzz.tallies().at(d->target).accepted : 0;
      fuzz.read(d->target, &d->text, nullptr, d, "original");
      EXPECT_EQ(fuzz.tallies().at(d->target).accepted, before + 1) << d->name << " is not accepted";
    }

    for (int64_t i = 0; i < budget.text_mutations; ++i) {
      const Document* seed = random.pick(seeds);
      std::string text = seed->text;
      const size_t rounds = 1 + random.below(2);
      for (size_t r = 0; r < rounds; ++r) mutate_text(text, random);
      fuzz.read(budget.target, &text, nullptr, seed, "byte-level");
    }
    for (int64_t i = 0; i < budget.json_mutations; ++i) {
      const Document* seed = random.pick(seeds);
      Json json = seed->json;
      const size_t rounds = 1 + random.below(3);
      const char* how = "json-level";
      for (size_t r = 0; r < rounds; ++r) how = mutate_json(json, random);
      fuzz.read(budget.target, nullptr, &json, seed, how);
    }
  }
  // parse_json_text alone: token soup, and every document cut at a random point.
  for (int64_t i = 0; i < kTokenSoups; ++i) {
    std::string text = token_soup(random);
    if (i % 2 == 1) {
      const std::string& whole = random.pick(docs).text;
      text = whole.substr(0, random.below(whole.size() + 1)) + text;
    }
    fuzz.read(Target::kJsonText, &text, nullptr, nullptr, "token soup");
  }

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int64_t accepted = 0;
  for (const auto& [target, tally] : fuzz.tallies()) {
    std::printf("parser fuzz: %-22s %7lld inputs, %6lld accepted\n", target_name(target),
                static_cast<long long>(tally.inputs), static_cast<long long>(tally.accepted));
    accepted += tally.accepted;
  }
  std::printf("parser fuzz: %lld inputs in all, %lld accepted, %.1f s\n", static_cast<long long>(fuzz.total()),
              static_cast<long long>(accepted), seconds);
  RecordProperty("inputs", std::to_string(fuzz.total()));
  RecordProperty("accepted", std::to_string(accepted));

  EXPECT_GE(fuzz.total(), 100'000);
  // Mutations that keep a document valid happen (a changed string, a nudged number), and
  // most do not: both branches of every reader ran.
  for (const auto& [target, tally] : fuzz.tallies()) {
    EXPECT_GT(tally.accepted, 0) << target_name(target);
    EXPECT_LT(tally.accepted, tally.inputs) << target_name(target);
  }
  for (const auto& [problem, count] : fuzz.problems())
    ADD_FAILURE() << problem << " (" << count << " inputs)\n  first: " << fuzz.examples().at(problem);
}

}  // namespace
}  // namespace moeplan
