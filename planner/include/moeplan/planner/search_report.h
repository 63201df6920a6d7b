#pragma once
// `moeplan search` as a whole, below the command line: the request searched, the plan written
// and everything the command shows, as text. The CLI parses the flags into a SearchRequest and
// ReportOptions and prints what comes back; the text is the command's (docs/commands.md).

#include <functional>
#include <string>

#include "moeplan/planner/request.h"

namespace moeplan::planner {

// What the command shows (the request's `top` candidates) and writes.
struct ReportOptions {
  bool explain = false;          // the counts of candidates each rule or limit removed
  bool json = false;             // the plan as JSON instead of the table
  std::string out = "plan.json";  // the plan file written; empty: none
};

// Shows text on standard output as soon as it is known (a range of sizes takes a while).
using Print = std::function<void(const std::string&)>;

// How the command ends: what it says on standard error, and its exit code
// (moeplan/core/exit_codes.h).
struct SearchReport {
  std::string err;
  int exit_code = 0;
};

// Searches `request` (a range of cluster sizes: each size, then the one its objective picks),
// writes the plan to options.out, recording `command` in it, and then gives `print` what the
// command shows on standard output: what is searched and each size of a range once searched (as
// the search goes), the ranked table (or the plan as JSON), and the file written. Throws
// InputError naming the flag at fault.
SearchReport search_and_report(const SearchRequest& request, const ReportOptions& options, const std::string& command,
                               const Print& print);

}  // namespace moeplan::planner
