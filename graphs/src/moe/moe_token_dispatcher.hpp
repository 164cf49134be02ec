// The MoE layer's token dispatcher's work on one slot's rows, which the MoE MLP's tasks run.
#pragma once

#include "moe/moe_activations.hpp"
#include "step/rank_program.hpp"

namespace weave::graphs {

// After the router: the slot's dispatch plan (capacity per slot), the rank's routed and dropped
// picks counted (unless `counted` is false: a recomputed forward's were counted the first time),
// and the rows permuted into expert order or framed for the dispatch all-to-all (per item under
// --use-pipe-experts), as layer `layer`'s spec says.
void permute_slot(RankProgram& P, int layer, MoeSlot& A, bool counted);
// Before the router's backward: the items' input gradients back into the slot's rows, and the
// permutation undone into d_moe_in (a 16-bit run's: values of its precision).
void unpermute_gradients(const StepShape& z, MoeSlot& A, bool half);

// Frames a slot's rows for the dispatch all-to-all: for each destination rank, header rows with
// the row counts of its local experts, then the rows themselves in expert order.
void frame_dispatch(const StepShape& z, MoeSlot& slot);
// The same per item: for each destination, a header row with the count, then the item's slice
// of the rows for that rank's local expert.
void frame_items(const StepShape& z, MoeSlot& slot);
// Regroups rows that arrived grouped by source (each source's rows by local expert) into rows
// grouped by local expert, reading the per-expert counts from each source's header rows.
void regroup_by_expert(const StepShape& z, MoeSlot& slot);

}  // namespace weave::graphs
