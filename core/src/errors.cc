#include "moeplan/core/errors.h"

namespace moeplan {

std::string Diagnostic::to_string() const {
  return path.empty() ? message : path + ": " + message;
}

static std::string first_line(const std::string& origin, const std::vector<Diagnostic>& items) {
  std::string text = origin;
  if (!items.empty()) {
    text += ": " + items.front().to_string();
    if (items.size() > 1) text += " (and " + std::to_string(items.size() - 1) + " more)";
  }
  return text;
}

InputError::InputError(std::string origin, std::vector<Diagnostic> diagnostics)
    : std::runtime_error(first_line(origin, diagnostics)),
      origin_(std::move(origin)),
      diagnostics_(std::move(diagnostics)) {}

std::vector<std::string> InputError::lines() const {
  std::vector<std::string> out;
  out.reserve(diagnostics_.size());
  for (const Diagnostic& d : diagnostics_) out.push_back(origin_ + ": " + d.to_string());
  return out;
}

void Diagnostics::error(std::string path, std::string message) {
  items_.push_back({std::move(path), std::move(message)});
}

void Diagnostics::throw_if_any(std::string origin) const {
  if (!items_.empty()) throw InputError(std::move(origin), items_);
}

}  // namespace moeplan
