#pragma once
// For tests that plan for a framework: its rules, and one of them, by name.

#include <cstdlib>
#include <string_view>

#include "moeplan/core/rules.h"
#include "moeplan/frameworks/framework.h"

namespace moeplan::test {

inline Target framework_rules(std::string_view framework_name) {
  const Framework* f = find_framework(framework_name);
  if (!f) std::abort();  // a test names a framework that is not in the list
  return f->target;
}

// The Rule value of the framework's rule `rule_name` (the search's bit for it).
inline Rule framework_rule(std::string_view framework_name, std::string_view name) {
  const Target target = framework_rules(framework_name);
  for (int r = kRuleCount; r < kRuleBits; ++r)
    if (rule_name(static_cast<Rule>(r), target) == name) return static_cast<Rule>(r);
  std::abort();  // not one of its rules
}

}  // namespace moeplan::test
