// The parallel plans a configuration could run on its devices, and their predicted steps ranked:
// `weave predict --advise`. A plan is data (a TrainerConfig), so every candidate can be printed
// as the flags that select it and predicted on its own with the same result.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "weave/graphs/prediction.hpp"
#include "weave/graphs/trainer_config.hpp"

namespace weave::graphs {

struct PlanSearchOptions {
  // The largest tensor-parallel size tried; 0: no limit but the heads'. A modelled cluster's
  // devices per node is the sensible limit: tensor parallelism across nodes costs a collective
  // over the network in every layer.
  int max_tensor_parallel = 0;
  // The flags given that have no effect (by their table names): candidates are refused by the
  // rules the flag table declares with them (check_flag_rules), as a run with them would be.
  std::vector<std::string> flags_without_effect;
};

// A reason validate gave, and how many candidates it refused for it.
struct RefusalCount {
  std::string reason;  // the message with its numbers as N, so the same rule counts once
  int candidates = 0;
};

struct PlanCandidates {
  std::vector<TrainerConfig> configs;  // each passed validate, cheapest to predict first
  int skipped_global_batch = 0;        // dp did not divide the global batch (not tried)
  std::vector<RefusalCount> refused;   // validate refused them, most refused first
  int refused_total() const;
};

// Every plan over base.plan.devices() devices: tp dividing the heads (and the query groups),
// pp dividing the layers, cp where the sequence splits into 2 cp chunks, ep dividing the experts
// (a MoE model's), dp the rest; for pp > 1 the schedules 1f1b, interleaved (2 chunks per rank,
// where the layers allow) and zb-h1; Ampipe degree 1 and 2 (MoE); no recomputation and full
// uniform recomputation of one layer; sequence parallelism with tp > 1. The global and micro-
// batch sizes, precision, the distributed optimizer and the rest are base's. Ordered by the
// ranks a folded prediction builds (tp x cp x pp), fewest first.
PlanCandidates enumerate_plans(const TrainerConfig& base, const PlanSearchOptions& options = {});

// The flags that select `config`'s plan, by Megatron-LM's names: devices, parallel sizes,
// schedule, Ampipe degree, recomputation and the global batch size.
std::string plan_flags(const TrainerConfig& config);

// A candidate's prediction, kept without its trace.
struct PlanOutcome {
  TrainerConfig config;
  double step_ms = 0;
  double tokens_per_second = 0;
  double mfu = 0;
  double bubble = 0;
  std::int64_t memory_per_device = 0;  // the most any device holds at its peak
  std::int64_t tasks_built = 0;        // Prediction::tasks_built
  bool fits = false;                   // memory_per_device <= the device's capacity
};

struct PlanRankingOptions {
  std::int64_t device_memory_bytes = 0;  // each device's capacity
  int max_predictions = 0;               // 0: no limit; else predict only the first this many
  PredictionOptions prediction;
  // Predictions run side by side (each builds and replays its own step), at most one a core:
  // 0 takes every core.
  // The ranking is the same whatever the count.
  int concurrent_predictions = 0;
  // The memory the predictions running side by side may hold together, each's estimated before
  // it starts (prediction_memory_bound): a candidate waits, in turn, while it would not fit
  // beside those running; one runs alone whatever its estimate. 0: no budget. The ranking is the
  // same whatever the budget.
  std::int64_t memory_budget_bytes = 0;
  // Called after each prediction with the count done and the count to do (from one thread at
  // a time).
  std::function<void(int done, int total)> progress;
};

struct PlanRanking {
  std::vector<PlanOutcome> fitting;  // by predicted step time, fastest first
  int too_large = 0;                 // predicted, discarded for memory
  int predicted = 0;
  // Refused while the step was built (rules the step's builder holds, such as recomputation
  // under a zero-bubble schedule), by reason.
  std::vector<RefusalCount> refused;
  int not_predicted = 0;                  // beyond max_predictions
  int most_side_by_side = 0;              // the most predictions that ran at once
  std::int64_t most_estimated_bytes = 0;  // the most their estimates added up to at once
};

// Predicts each candidate (graphs::predict_step) in order and ranks those that fit; a candidate
// whose step cannot be built is counted by the reason.
PlanRanking rank_plans(const std::vector<TrainerConfig>& candidates,
                       const PlanRankingOptions& options);

// A prediction's outcome against a capacity (the largest device's peak).
PlanOutcome outcome_of(const TrainerConfig& config, const Prediction& prediction,
                       std::int64_t device_memory_bytes);

}  // namespace weave::graphs
