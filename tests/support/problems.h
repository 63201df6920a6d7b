#pragma once
// For tests of bad input: the diagnostics an InputError carries.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moeplan/core/errors.h"

namespace moeplan::test {

// Runs read(), which must throw InputError from `origin`; returns its diagnostics.
template <class F>
std::vector<Diagnostic> problems_of(F&& read, const std::string& origin) {
  try {
    read();
  } catch (const InputError& e) {
    EXPECT_EQ(e.origin(), origin);
    EXPECT_FALSE(e.diagnostics().empty());
    return e.diagnostics();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-InputError: " << e.what();
    return {};
  }
  ADD_FAILURE() << "accepted the input from " << origin;
  return {};
}

}  // namespace moeplan::test
