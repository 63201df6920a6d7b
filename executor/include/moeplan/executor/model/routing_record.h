#pragma once
// A rehearsal's routing record (docs/executor.md, "Rehearsal"). The layout's ranks write, each
// step, the router logits of every layer and micro-batch they routed and the experts they sent
// each token to. The one-rank reference replays those choices instead of making its own, so
// that the two compute the same function and differ only by the order of their sums; while it
// replays, it compares its own router logits with the layout's and says where its own routing
// would have chosen otherwise.
//
// Micro-batches are numbered as the one-rank reference reads them: reader r's micro-batch m of
// a step is r x G + m, G the micro-batches a reader trains a step (run.h). Where a rank routes
// part of a micro-batch (context-parallel ranks, folded tensor ranks), it records which rows of
// the micro-batch's [B x T] tokens it routed, and the replay puts the parts together in the
// reference's order.

#include "moeplan/executor/libtorch.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moeplan/core/json_reader.h"
#include "moeplan/core/model_spec.h"
#include "moeplan/core/parallel_config.h"
#include "moeplan/executor/model/routing.h"

namespace moeplan::executor {

// What one rank of the layout routed in a step.
class RoutingRecorder {
 public:
  RoutingRecorder(std::string dir, int64_t rank) : dir_(std::move(dir)), rank_(rank) {}
  // One layer of one micro-batch: logits [tokens, experts], experts [tokens, k], which of those
  // slots the capacity kept (bool [tokens, k]; undefined when dropless), and the rows of the
  // micro-batch's tokens they are (int64 [tokens]; undefined: all of them, in order).
  void add(int64_t micro_batch, int64_t layer, const torch::Tensor& logits, const torch::Tensor& experts,
           const torch::Tensor& kept = {}, const torch::Tensor& rows = {});
  // Writes the step's record, <dir>/step-<8 digits>/rank-<5 digits>.safetensors (logits F32,
  // experts U8 and, when tokens were dropped, kept U8, and for part of a micro-batch its rows
  // I64, named "m<micro-batch>/l<layer>/logits", ".../experts", ".../kept" and ".../rows"), and
  // starts the next.
  void write(int64_t step);

 private:
  // Host buffers rather than tensors: a rehearsal measures the live tensors of a step, and the
  // record is not part of training.
  struct Entry {
    int64_t micro_batch = 0, layer = 0, tokens = 0, experts = 0, k = 0;
    std::vector<float> logits;
    std::vector<uint8_t> chosen;
    std::vector<uint8_t> kept;  // empty when dropless
    std::vector<int64_t> rows;  // empty: the whole micro-batch
  };
  std::string dir_;
  int64_t rank_ = 0;
  std::vector<Entry> entries_;
};

// What the reference found while it replayed one step.
struct ReplayedStep {
  int64_t step = 0;
  int64_t slots = 0;         // token-expert slots replayed
  int64_t unrecorded = 0;    // (micro-batch, layer) pairs the record lacks: routed by the reference itself
  int64_t unlike_route = 0;  // slots where the layout's choice is not route() of its own logits
  int64_t near_ties = 0;     // slots that route() of the reference's own logits sends elsewhere
  // Per layer, over its micro-batches: the largest root mean square over tokens of the norm of
  // the difference between the reference's router logits and the layout's, and where.
  std::vector<double> logit_difference;
  std::vector<int64_t> logit_difference_micro_batch;

  Json to_json() const;
};

// The reference's side: the record read one step at a time.
class RoutingReplay {
 public:
  // The record in `dir`; the findings go to `findings_path` (routing-replay.json) after each step.
  RoutingReplay(std::string dir, std::string findings_path, const ModelSpec& spec, LoadBalancing method)
      : dir_(std::move(dir)), findings_path_(std::move(findings_path)), spec_(spec), method_(method) {}
  // Under sigmoid scoring the layout chose by score plus the balancing bias of the step's start
  // (every block with experts' row of [moe blocks, experts]; expert_bias.h).
  void set_expert_bias(const torch::Tensor& bias) { bias_ = bias; }
  // Reads the record of `step`; InputError naming the folder when it has none.
  void start_step(int64_t step);
  // The choices of micro-batch `micro_batch`, layer by layer.
  RouteOverride micro_batch(int64_t micro_batch);
  // Adds the step's findings to the file (a JSON object {"steps": [...]}).
  void finish_step();

 private:
  ChosenExperts replay(int64_t micro_batch, int64_t layer, const torch::Tensor& logits);
  Routing own_route(int64_t layer, const torch::Tensor& logits) const;

  std::string dir_, findings_path_;
  ModelSpec spec_;
  LoadBalancing method_;
  torch::Tensor bias_;
  struct Recorded {
    torch::Tensor logits, experts, kept;  // kept: undefined when dropless
    torch::Tensor rows;                   // a part's rows of the micro-batch (undefined: all)
    int64_t parts = 1;                    // the ranks' parts it was put together from
  };
  std::map<std::pair<int64_t, int64_t>, Recorded> record_;
  ReplayedStep current_;
  std::vector<ReplayedStep> done_;
};

// Reads a routing-replay.json; InputError with the field path on anything else.
std::vector<ReplayedStep> read_replayed_steps(const std::string& path);

}  // namespace moeplan::executor
