// A rank's part of the pipeline schedule: the actions of its stage, in an order that respects
// every dependency between stages (emission_order), and its ends of the transfers between
// stages. Every rank walks the same order, so the two ends of a transfer are issued at the same
// point and meet in order. Then the tied word embedding's gradient is summed over the first and
// last stage (Megatron's embedding group) and the embedding buckets are reduced.
#pragma once

#include "step/rank_program.hpp"

namespace weave::graphs {

void build_pipeline(RankProgram& P);

}  // namespace weave::graphs
