// `weave train --ampipe-advise` and `--pipeline-advise`: instead of training, one step of the
// configuration replayed on the virtual clock under each Ampipe degree or pipeline schedule,
// printed as a table with the fastest named.
#pragma once

#include "weave/graphs/trainer_config.hpp"
#include "weave/graphs/training_data.hpp"

namespace weave::cli {

// `config` has passed graphs::validate. Return the program's exit code; throw ConfigError when
// no candidate can run the configuration.
int advise_ampipe(const graphs::TrainerConfig& config, const graphs::SampleSource& samples,
                  bool fast);
int advise_pipeline(const graphs::TrainerConfig& config, const graphs::SampleSource& samples);

}  // namespace weave::cli
