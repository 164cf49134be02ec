// The end of a rank's step: the squared gradient norm of the elements it owns, summed over every
// rank, clipping, AdamW on its parameters (its shard of each bucket under the distributed
// optimizer, whose replicas then all-gather the updated values; with --overlap-param-gather they
// gather them at the start of the next step instead).
#pragma once

#include "step/rank_program.hpp"

namespace weave::graphs {

void build_optimizer(RankProgram& P);

// --overlap-param-gather (with the distributed optimizer): issues, before anything else of the
// step, the all-gather of every sharded bucket's values, in the order the forward reads them,
// and records them in P.parameter_gathers for the modules' forwards to wait for
// (RankProgram::wait_for_parameters). They gather what the previous step's update produced; at
// the first step, values every replica holds already (the same bits). Nothing without the flag.
void start_parameter_gathers(RankProgram& P);

// The same gathers as a graph of their own, issued through `matcher` into `graph` for rank
// P.rank: what brings every replica up to date after the last step (TrainingStep's
// parameter_gather_graph).
void add_parameter_gathers(RankProgram& P, devices::CollectiveMatcher& matcher,
                           rt::GraphBuilder& graph);

}  // namespace weave::graphs
