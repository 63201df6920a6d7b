#include "moeplan/core/training_log.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "moeplan/core/errors.h"

namespace moeplan {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Without terminal colour codes (ESC [ ... m), which torchtitan's log lines carry.
std::string without_colours(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\x1b' && i + 1 < s.size() && s[i + 1] == '[') {
      size_t j = i + 2;
      while (j < s.size() && s[j] != 'm') ++j;
      i = j;
      continue;
    }
    out += s[i];
  }
  return out;
}

// A finite number at the start of `s` (thousands separators allowed); nullopt otherwise.
std::optional<double> number_at(std::string_view s) {
  std::string digits;
  for (char c : trim(s)) {
    if (c == ',') continue;
    if (std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '+' || c == 'e' || c == 'E')
      digits += c;
    else
      break;
  }
  if (digits.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(digits.c_str(), &end);
  if (end != digits.c_str() + digits.size() || errno == ERANGE || !std::isfinite(v)) return std::nullopt;
  return v;
}

// Counts read from a log (iterations, batch sizes) stay far from int64's range.
constexpr double kMaxCount = 1e15;

// The number after `key` in `s`; nullopt when the key is missing or no number follows.
std::optional<double> after(std::string_view s, std::string_view key) {
  const size_t at = s.find(key);
  if (at == std::string_view::npos) return std::nullopt;
  return number_at(s.substr(at + key.size()));
}

// An iteration or batch number as read: there, and a count.
bool is_count(const std::optional<double>& v) { return v && *v >= 0 && *v <= kMaxCount; }

// Where one format's iteration line keeps its numbers.
struct IterationKeys {
  LogFormat format;
  std::string_view iteration;           // the iteration number
  std::string_view rate;                // a positive number: the elapsed time or a throughput
  double LoggedIteration::*rate_field;  // where that number goes
  std::string_view tflops;              // TFLOP/s per GPU, where logged
  std::string_view loss;                // where logged
  const char* unreadable;               // what a line is whose iteration or rate cannot be read
};

constexpr IterationKeys kMegatronIteration{
    LogFormat::kMegatron, " iteration ", "elapsed time per iteration (ms):", &LoggedIteration::step_ms,
    "throughput per GPU (TFLOP/s/GPU):", "lm loss:",
    "is a Megatron-LM iteration line without a readable iteration number and elapsed time"};
constexpr IterationKeys kTorchtitanIteration{LogFormat::kTorchtitan, "step:", "tps:",
                                             &LoggedIteration::tokens_per_s_per_gpu, "tflops:", "loss:",
                                             "is a torchtitan step line without a readable step and tps"};
constexpr IterationKeys kSmpIteration{LogFormat::kSmp, "Batch ", "Speed:", &LoggedIteration::samples_per_s,
                                      "Model TFLOPS/GPU:", "Loss:",
                                      "is a line of SMP's script without a readable Batch and Speed"};

class Reader {
 public:
  explicit Reader(std::string origin) : origin_(std::move(origin)) {}

  void line(int64_t number, std::string_view raw) {
    const std::string text = without_colours(raw);
    if (text.find(" iteration ") != std::string::npos && text.find("elapsed time per iteration (ms):") != std::string::npos)
      megatron(number, text);
    else if (text.find("memory (MB)") != std::string::npos && text.find("max allocated:") != std::string::npos)
      megatron_memory(number, text);
    else if (const size_t dots = text.find(" ...."); dots != std::string::npos && text.find("): (") == std::string::npos &&
                                                    text.find(": (") != std::string::npos)
      megatron_timer(number, text, dots);
    else if (text.find("step:") != std::string::npos && text.find("tps:") != std::string::npos)
      torchtitan(number, text);
    else if (text.find("'train_runtime':") != std::string::npos &&
             text.find("'train_steps_per_second':") != std::string::npos)
      trainer(number, text);
    else if (text.find("Batch ") != std::string::npos && text.find(" Loss: ") != std::string::npos &&
             text.find("samples/sec") != std::string::npos && text.find("Running Avg") == std::string::npos)
      smp(number, text);
  }

  TrainingLog finish() {
    if (log_.iterations.empty())
      throw InputError(origin_, {{"", "holds no iteration line of Megatron-LM (\"iteration N/M | ... elapsed time per "
                                      "iteration (ms): ...\"), torchtitan (\"step: N  loss: ...  tps: ...\"), SMP's "
                                      "example script (\"Batch N Loss: ..., Speed: ... samples/sec\") or the "
                                      "Hugging Face Trainer ({'train_runtime': ..., 'train_steps_per_second': ...})"}});
    return std::move(log_);
  }

 private:
  [[noreturn]] void bad(int64_t number, const std::string& what) const {
    throw InputError(origin_, {{"line " + std::to_string(number), what}});
  }

  void expect(int64_t number, LogFormat format) {
    if (!format_) {
      format_ = format;
      log_.format = format;
    } else if (*format_ != format) {
      bad(number, "is a " + std::string(log_format_name(format)) + " line in a " +
                      std::string(log_format_name(*format_)) + " log (one run's log at a time)");
    }
  }

  // An iteration line of the format `keys` describes; `rest_readable` false (a number of the
  // format's own that cannot be read) makes the line unreadable too.
  LoggedIteration iteration_line(int64_t number, const std::string& text, const IterationKeys& keys,
                                 bool rest_readable = true) {
    expect(number, keys.format);
    LoggedIteration it;
    it.line = number;
    const auto iteration = after(text, keys.iteration);
    const auto rate = after(text, keys.rate);
    if (!is_count(iteration) || !rate || *rate <= 0 || !rest_readable) bad(number, keys.unreadable);
    it.iteration = static_cast<int64_t>(*iteration);
    it.*keys.rate_field = *rate;
    it.tflops_per_gpu = after(text, keys.tflops).value_or(0);
    it.loss = after(text, keys.loss).value_or(0);
    return it;
  }

  void megatron(int64_t number, const std::string& text) {
    const auto batch = after(text, "global batch size:");
    LoggedIteration it = iteration_line(number, text, kMegatronIteration, !batch || is_count(batch));
    it.global_batch = static_cast<int64_t>(batch.value_or(0));
    log_.iterations.push_back(it);
  }

  void megatron_memory(int64_t number, const std::string& text) {
    expect(number, LogFormat::kMegatron);
    const auto mb = after(text, "max allocated:");
    if (!mb || *mb < 0) bad(number, "is a Megatron-LM memory report without a readable \"max allocated\"");
    log_.max_allocated_bytes = std::max(log_.max_allocated_bytes, *mb * 1024 * 1024);
  }

  // "    forward-backward ...................................: (1234.56, 1240.12)"
  void megatron_timer(int64_t number, const std::string& text, size_t dots) {
    const std::string name(trim(std::string_view(text).substr(0, dots)));
    if (name.empty() || name.find(' ') != std::string::npos) return;  // not a timer line
    const size_t open = text.find(": (", dots);
    const size_t comma = text.find(',', open);
    if (comma == std::string::npos) return;
    const auto max_ms = number_at(std::string_view(text).substr(comma + 1));
    if (!max_ms || *max_ms < 0) bad(number, "is a Megatron-LM timer line without a readable (min, max)");
    expect(number, LogFormat::kMegatron);
    log_.timer_max_ms[name].push_back(*max_ms);
  }

  void torchtitan(int64_t number, const std::string& text) {
    LoggedIteration it = iteration_line(number, text, kTorchtitanIteration);
    if (const auto gib = after(text, "memory:")) it.memory_bytes = *gib * 1024 * 1024 * 1024;
    log_.iterations.push_back(it);
  }

  // {'train_runtime': 1234.5, 'train_samples_per_second': 12.3, 'train_steps_per_second': 0.39, ...}
  void trainer(int64_t number, const std::string& text) {
    expect(number, LogFormat::kHfTrainer);
    LoggedIteration it;
    it.line = number;
    const auto steps = after(text, "'train_steps_per_second':");
    const auto samples = after(text, "'train_samples_per_second':");
    if (!steps || *steps <= 0 || !samples || *samples <= 0)
      bad(number, "is a Hugging Face Trainer summary without readable train_steps_per_second and "
                  "train_samples_per_second");
    it.iteration = static_cast<int64_t>(log_.iterations.size());
    it.step_ms = 1000.0 / *steps;
    it.samples_per_s = *samples;
    it.loss = after(text, "'train_loss':").value_or(0);
    log_.iterations.push_back(it);
  }

  void smp(int64_t number, const std::string& text) {
    if (text.find("Validation") != std::string::npos) return;
    log_.iterations.push_back(iteration_line(number, text, kSmpIteration));
  }

  std::string origin_;
  std::optional<LogFormat> format_;
  TrainingLog log_;
};

}  // namespace

std::string_view log_format_name(LogFormat format) {
  switch (format) {
    case LogFormat::kMegatron: return "Megatron-LM";
    case LogFormat::kTorchtitan: return "torchtitan";
    case LogFormat::kSmp: return "SMP";
    case LogFormat::kHfTrainer: return "Hugging Face Trainer";
  }
  return "?";
}

TrainingLog parse_training_log(std::string_view text, const std::string& origin) {
  Reader reader(origin);
  int64_t number = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    ++number;
    std::string_view line = text.substr(start, end - start);
    if (line.find('\0') != std::string_view::npos)
      throw InputError(origin, {{"line " + std::to_string(number), "holds a NUL byte: not a text log"}});
    reader.line(number, line);
    start = end + 1;
  }
  return reader.finish();
}

TrainingLog read_training_log(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, {{"", std::string("cannot open: ") + std::strerror(errno)}});
  std::ostringstream text;
  text << in.rdbuf();
  return parse_training_log(text.str(), path);
}

}  // namespace moeplan
