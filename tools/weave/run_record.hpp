// The "run" and "summary" records of `weave train --log-json`: the whole configuration a run
// trained with (after the flags' defaults, derivations and validation), and what it did.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "weave/graphs/trainer.hpp"
#include "weave/graphs/trainer_config.hpp"

namespace weave::cli {

// The flag table's description of the configuration (graphs::describe_configuration): keys are
// the flags' names with underscores, the values those the run uses.
nlohmann::json run_record(const graphs::TrainerConfig& config, const std::string& data,
                          const std::vector<std::string>& no_effect);

nlohmann::json summary_record(const graphs::TrainingSummary& done, std::int64_t iteration);

}  // namespace weave::cli
