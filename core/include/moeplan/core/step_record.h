#pragma once
// One training step as a run measured it: a line of the run's metrics.jsonl (docs/executor.md,
// "Metrics"). The executor writes them; `moeplan routing` and the tests read them back.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moeplan/core/json_reader.h"

namespace moeplan {

// Token-expert slots indexed [group][micro-batch][layer][expert].
using ExchangeSlots = std::vector<std::vector<std::vector<std::vector<int64_t>>>>;

struct StepRecord {
  int64_t step = 0;
  double loss = 0;        // language-model cross entropy, mean over micro-batches
  double aux_loss = 0;
  double z_loss = 0;
  double total_loss = 0;  // what was differentiated
  double learning_rate = 0;
  double grad_norm = 0;   // before clipping
  int64_t tokens = 0;
  double seconds = 0;
  std::vector<std::vector<int64_t>> tokens_per_expert;  // [layer][expert] token-expert slots
  // The same per micro-batch of each expert group (the ranks one dispatch spans, numbered
  // r S + s by their replica and shard coordinates): what each exchange carried. A layer on
  // another pipeline stage is counted by that stage's ranks.
  ExchangeSlots exchange_slots;
  // Each rank's seconds inside its expert group's exchanges in the step (dispatch and combine,
  // forward and backward, the wait for the group's busiest rank included); empty without E > 1.
  std::vector<double> exchange_seconds;
  // Per layer, the slots of tokens_per_expert that an expert's capacity dropped (summed over the
  // step's micro-batches and ranks); empty when the plan is dropless.
  std::vector<int64_t> dropped_slots;
  // A NaN or an Inf in the loss or the gradients: the update was not applied (the step's data
  // is consumed and the schedule moves on, as Megatron-LM skips such iterations), and where
  // it began.
  bool skipped = false;
  std::string nonfinite;
  // The share of the machine's processor time that its hypervisor gave to other guests during
  // the step (Linux's steal time in /proc/stat, all processors together); none where the
  // machine does not say. Such time is taken from the ranks, so the step runs slower for a
  // reason outside the run (docs/validation.md, "A shared machine").
  std::optional<double> steal;
  bool operator==(const StepRecord&) const = default;

  // The step's token-expert slots over every layer (what the router asked for), and of them
  // those dropped at capacity.
  int64_t total_slots() const;
  int64_t total_dropped() const;
};

// A step the hypervisor left alone: it took under this share of the machine's processor time
// during the step. On the 2-vCPU VMs moeplan is validated on, steal is 0 in most 2-second
// windows and 2 to 40% in spells (docs/validation.md).
inline constexpr double kUndisturbedSteal = 0.01;
inline bool undisturbed(const StepRecord& r) { return r.steal && *r.steal < kUndisturbedSteal; }

// One metrics.jsonl line (no newline). A NaN or an Inf loss is written as null.
std::string to_json_line(const StepRecord& record);
// A line read back, strictly: every field checked, null losses read as NaN.
StepRecord step_record_from_json(const Json& json, const std::string& origin);
// Every line of a metrics.jsonl file; an error names the file and the line.
std::vector<StepRecord> read_step_records(const std::string& path);

}  // namespace moeplan
