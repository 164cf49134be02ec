// A rank's part of the pipeline schedule: the actions of its stage and its ends of the transfers
// between stages, in the order of the schedule's lowered steps (lower_transfers), which the
// schedule's own task graph runs too. Every rank walks the same steps and issues both ends of a
// transfer at one of them, so the two ends meet in order. Then the tied word embedding's
// gradient is summed over the first and last stage (Megatron's embedding group) and the
// embedding buckets are reduced.
#pragma once

#include "step/rank_program.hpp"

namespace weave::graphs {

void build_pipeline(RankProgram& P);

}  // namespace weave::graphs
