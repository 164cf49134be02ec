// The end of a rank's step: the squared gradient norm of the elements it owns, summed over every
// rank, clipping, AdamW on its parameters (its shard of each bucket under the distributed
// optimizer, whose replicas then all-gather the updated values).
#pragma once

#include "step/rank_program.hpp"

namespace weave::graphs {

void build_optimizer(RankProgram& P);

}  // namespace weave::graphs
