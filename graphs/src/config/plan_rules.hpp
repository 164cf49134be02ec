// The rules a parallel plan must keep, each a short function named for what it checks.
#pragma once

#include "weave/graphs/model_config.hpp"
#include "weave/graphs/parallel_plan.hpp"

namespace weave::graphs {

// Checks every rule, in the order their refusals are reported, and throws ConfigError for the
// first one broken. `given` is the plan as the flags give it, `derived` the same after
// derive_plan(): a rule about a flag the derivation may overwrite reads the flag as given.
void check_plan_rules(const ModelConfig& model, const ParallelPlan& given,
                      const ParallelPlan& derived);

}  // namespace weave::graphs
