// Advice from predict's engine (graphs::predict_step: the step built without tensors, data-
// parallel replicas folded, replayed on the virtual clock of the modelled machine):
// `--ampipe-advise` and `--pipeline-advise` (weave train and weave predict) compare Ampipe
// degrees or pipeline schedules of one configuration; `weave predict --advise` searches the
// parallel plans over its devices. Each prints a table; a candidate that does not fit the
// device's memory is marked and never named fastest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weave/graphs/plan_search.hpp"
#include "weave/graphs/trainer_config.hpp"

namespace weave::cli {

// `config` has passed graphs::validate. Return the program's exit code; throw ConfigError when
// no candidate can run the configuration or none fits `device_memory_bytes`.
int advise_ampipe(const graphs::TrainerConfig& config, std::int64_t device_memory_bytes,
                  const std::vector<std::string>& flags_without_effect);
int advise_pipeline(const graphs::TrainerConfig& config, std::int64_t device_memory_bytes);

struct PlanAdviceOptions {
  std::int64_t device_memory_bytes = 0;
  int top = 10;               // --advise-top: rows printed
  int max_predictions = 500;  // --advise-limit
  // --advise-memory-budget: what the predictions side by side may hold together (0: no budget).
  std::int64_t memory_budget_bytes = 0;
  bool fold = true;  // fold replicas, tensor- and context-parallel peers, micro-batches
  // The command line's flags other than the plan's, to print the best plan as a command.
  std::string model_flags;
  // The flags given that have no effect: the rules the flag table declares with them still
  // refuse candidates (an Ampipe degree beside a feature MindSpeed's Ampipe refuses).
  std::vector<std::string> flags_without_effect;
};
int advise_plans(const graphs::TrainerConfig& config, const PlanAdviceOptions& options);

}  // namespace weave::cli
