#pragma once
// Errors a user can cause. Every message names where the problem is (a field path such as
// "parallel.expert_parallel_degree", a command-line flag or a file) and the rule it breaks.
// Bugs are asserts, not these.

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moeplan {

// One problem found in an input, at a field path.
struct Diagnostic {
  std::string path;     // e.g. "parallel.hybrid_shard_degree"; empty for the whole input
  std::string message;  // e.g. "must be at least 1, got -2"

  std::string to_string() const;
};

// A malformed or inconsistent input. Carries every problem found, not only the first.
class InputError : public std::runtime_error {
 public:
  InputError(std::string origin, std::vector<Diagnostic> diagnostics);

  const std::string& origin() const { return origin_; }
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }
  // One line per problem, each prefixed with the origin ("plan.json: ...").
  std::vector<std::string> lines() const;

 private:
  std::string origin_;
  std::vector<Diagnostic> diagnostics_;
};

// Collects problems while reading an input, then throws them together.
class Diagnostics {
 public:
  void error(std::string path, std::string message);
  bool empty() const { return items_.empty(); }
  const std::vector<Diagnostic>& items() const { return items_; }
  // Throws InputError(origin, items) if anything was reported.
  void throw_if_any(std::string origin) const;

 private:
  std::vector<Diagnostic> items_;
};

}  // namespace moeplan
