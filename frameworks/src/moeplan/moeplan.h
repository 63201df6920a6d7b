#pragma once
// moeplan's executor's parts, put together in framework.cc.

#include "moeplan/core/rules.h"

namespace moeplan::frameworks {

// What the executor trains, as rules (rules.cc): the executor checks every plan it is given
// with them.
extern const TargetRules kMoeplanRules;

}  // namespace moeplan::frameworks
