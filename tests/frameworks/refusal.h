// The refusal an exporter or a rule gives, as one text: the frameworks' tests compare it.
#pragma once

#include <string>

#include "moeplan/core/errors.h"

namespace moeplan::test {

// The lines of an InputError, joined; empty when `f` throws none.
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    std::string all;
    for (const std::string& line : e.lines()) all += line + "\n";
    return all;
  }
  return "";
}

}  // namespace moeplan::test
