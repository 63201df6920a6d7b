#pragma once
// What the rules' tests share: a valid configuration to break one rule of, and violations as
// text for a failure message.

#include <string>
#include <vector>

#include "moeplan/core/rules.h"
#include "test_support.h"

namespace moeplan::test {

// The valid base every one-fault case starts from: Mixtral 8x7B on two p4d.24xlarge nodes,
// 16 ranks, E = 2, S = 8 (so R = 1), RSE, full checkpointing, mbs 1, ga 128, seq_len 2048:
// 16 x 1 x 128 x 2048 = 4,194,304 tokens per step.
inline Scenario rules_base() {
  Scenario s{model("mixtral-8x7b"), hardware("p4d.24xlarge", 16), {}, {}, {}};
  s.parallel.world_size = 16;
  s.parallel.expert_parallel_degree = 2;
  s.parallel.hybrid_shard_degree = 8;
  s.parallel.placement = *Placement::parse("RSE");
  s.parallel.activation_checkpointing = Checkpointing::kFull;
  s.parallel.micro_batch_size = 1;
  s.parallel.gradient_accumulation_steps = 128;
  s.training.seq_len = 2048;
  s.training.global_batch_tokens = 4'194'304;
  return s;
}

inline std::string describe_violations(const std::vector<Violation>& violations) {
  std::string text;
  for (const Violation& v : violations) text += "\n  [" + std::string(v.name) + "] " + v.to_string();
  return violations.empty() ? "(none)" : text;
}

}  // namespace moeplan::test
