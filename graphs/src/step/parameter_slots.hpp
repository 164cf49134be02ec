// ZeRO stage 3 (ParallelPlan::shard_parameters): a layer's parameters all-gathered from every
// replica's shard into its parameter slot before the layer's forward and again before its
// backward, on the replicas' streams, with the gathers of the next zero_units_in_flight - 1
// layers issued beside them; a slot is gathered into again only after the layer that held it has
// released it.
#pragma once

#include "step/rank_program.hpp"

namespace weave::graphs {

// Before layer `layer`'s forward or backward: its parameters gathered into its slot (unless the
// slot holds them still) and the next compute task made to wait for them; then `next`'s (the
// layer the pass reaches next, -1 for none) and those after it in the same direction gathered
// ahead into their own slots, up to ParallelPlan::zero_units_in_flight layers in all.
void acquire_layer_parameters(RankProgram& P, int layer, int next, const rt::TaskTags& tags);

// After layer `layer`'s forward or backward: a task on the compute stream after which its slot
// may be gathered into.
void release_layer_parameters(RankProgram& P, int layer, const rt::TaskTags& tags);

}  // namespace weave::graphs
