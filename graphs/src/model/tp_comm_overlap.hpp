// --tp-comm-overlap: sequence parallelism's collectives split into pieces pipelined with the
// products they feed or that feed them, as Megatron-Core's --tp-comm-overlap has Transformer
// Engine's userbuffers do: the all-gathers before a column-parallel product in forward (QKV, fc1)
// and before a row-parallel product's input gradient in backward (the projection's, fc2's) by
// ring exchange in tp pieces, the reduce-scatters after a row-parallel product in forward (the
// projection, fc2) pipelined in 4 (TE's initialize_ub defaults: num_splits is the tp size for
// ring_exchange, 4 for pipeline).
//
// Piece c of a collective is rows [c q, (c+1) q) of every tp rank's shard (q = Sl / pieces): in
// the rank's whole sequence ([Sc, ...], tp rank j's shard at rows [j Sl, (j+1) Sl)) the row
// ranges [j Sl + c q, j Sl + (c+1) q), one per tp rank. A piece's collective moves them through a
// staging buffer laid out in rank order (a collective's buffer is contiguous); its task runs the
// products over those rows only. A product split by rows computes each row as the whole product
// does (bit for bit where the pieces' rows are whole row blocks of the product kernel: multiples
// of 8 on the host), so the step's values are those without the overlap; the weight gradients,
// which sum over every row, stay whole.
//
// Where this differs from TE on the clock: a ring exchange's tp - 1 steps each bring one rank's
// shard, while a piece here brings 1 / pieces of every rank's shard (the same bytes in all); and
// TE's wgrad products of the projection and fc2 run under the ring exchange of their input
// gradients ("external" overlap), chunk by chunk, while here they run after the last piece over
// every row, so that the weight gradients' sums keep their order.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "step/rank_program.hpp"

namespace weave::graphs {

// `count` pieces of `rows` rows of each tp rank's shard.
struct TpPieces {
  int count = 1;
  std::int64_t rows = 0;
};

// Whether the dense layers pipeline their sequence-parallel collectives (--tp-comm-overlap with
// SP over more than one rank; Ampipe refuses it).
bool tp_overlaps(const StepShape& z);
// The gathers' pieces (TE's ring exchange: tp) and the reduce-scatters' (TE's pipeline: 4), or
// the largest count below that divides the shard's rows.
TpPieces tp_gather_pieces(const StepShape& z);
TpPieces tp_scatter_pieces(const StepShape& z);

// A task's price for `rows` rows of the sequence (times the micro-batch's samples).
using RowsCost = std::function<rt::CostHint(std::int64_t rows)>;

// What a piece's task runs over one of its row ranges [first, first + rows) of the rank's whole
// sequence.
using PieceRows = std::function<void(std::int64_t first, std::int64_t rows)>;

// The gather of `shard` ([Sl, ...]) into `full` ([Sc, ...]) piece by piece through `stage`
// (named "<gather_name>.p<c>"). The compute task "<name>.own" first runs `rows` over the rank's
// own shard's rows, which need no gather (as a ring exchange computes the rank's own chunk while
// the first one moves); then each piece's task "<name>.p<c>" moves its other ranks' rows into
// `full` and runs `rows` over each of them; the last then runs `after_last`, costing `last_cost`
// more. A task over r rows costs cost(r). Returns the last piece's task.
TaskId gather_in_pieces(RankProgram& P, TaskId ready, TpOverlapStage& stage, const Tensor& shard,
                        const Tensor& full, const std::string& gather_name, const std::string& name,
                        rt::TaskTags tags, const RowsCost& cost, PieceRows rows,
                        rt::CostHint last_cost = {}, std::function<void()> after_last = {});

// The compute tasks "<name>.p<c>" (after `ready`), each costing cost(its rows), running `rows` over
// its piece's row ranges and laying those rows of `full` ([Sc, ...]) out in `stage`, each
// followed by the reduce-scatter "<scatter_name>.p<c>" of its piece into `shard`'s rows
// ([Sl, ...]). Returns the last reduce-scatter.
TaskId scatter_in_pieces(RankProgram& P, TaskId ready, TpOverlapStage& stage, const Tensor& full,
                         const Tensor& shard, const std::string& name,
                         const std::string& scatter_name, rt::TaskTags tags, const RowsCost& cost,
                         PieceRows rows);

}  // namespace weave::graphs
