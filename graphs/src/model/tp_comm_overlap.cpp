#include "model/tp_comm_overlap.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace weave::graphs {

namespace {

TpPieces pieces_of(const StepShape& z, int wanted) {
  int count = std::max(1, wanted);
  while (z.Sl % count != 0)
    --count;
  return {.count = count, .rows = z.Sl / count};
}

// Runs `fn(row in full, row in stage, rows)` for each tp rank's range of piece c.
template <typename Fn>
void for_each_range(const StepShape& z, TpPieces pieces, int c, Fn fn) {
  const std::int64_t q = pieces.rows;
  for (int j = 0; j < z.t_sp; ++j)
    fn(j * z.Sl + c * q, (static_cast<std::int64_t>(c) * z.t_sp + j) * q, q);
}

}  // namespace

bool tp_overlaps(const StepShape& z) {
  return z.plan.tp_comm_overlap && z.sp() && z.sp_chunks() == 1;
}

TpPieces tp_gather_pieces(const StepShape& z) {
  return pieces_of(z, z.t_sp);
}

TpPieces tp_scatter_pieces(const StepShape& z) {
  return pieces_of(z, 4);
}

TaskId gather_in_pieces(RankProgram& P, TaskId ready, TpOverlapStage& stage, const Tensor& shard,
                        const Tensor& full, const std::string& gather_name, const std::string& name,
                        rt::TaskTags tags, const RowsCost& cost, PieceRows rows,
                        rt::CostHint last_cost, std::function<void()> after_last) {
  const StepShape& z = P.shape;
  const TpPieces pieces = tp_gather_pieces(z);
  const std::int64_t q = pieces.rows, n = q * z.t_sp, Sl = z.Sl;
  const std::int64_t own = P.tensor.member() * Sl;
  const Tensor staged = stage.buffer;
  // The rank's own rows first: they need no gather, as a ring exchange's first step computes
  // the rank's own chunk while the next one moves.
  TaskId task = P.compute(fmt::format("{}.own", name), tags, cost(Sl), [=] {
    full.slice(0, own, Sl).copy_from(shard);
    rows(own, Sl);
  });
  P.after(ready, task);
  for (int c = 0; c < pieces.count; ++c) {
    const TaskId gathered = P.tensor.all_gather(ready, read_of(shard.slice(0, c * q, q)),
                                                all_of(staged.slice(0, c * n, n)),
                                                fmt::format("{}.p{}", gather_name, c), tags);
    P.after(stage.last_use, gathered);  // the stage's previous use has read it
    const bool last = c + 1 == pieces.count;
    const TaskId previous = task;
    const rt::CostHint piece = cost(q * (z.t_sp - 1));
    task =
        P.compute(fmt::format("{}.p{}", name, c), tags, last ? piece + last_cost : piece, [=, &z] {
          for_each_range(z, pieces, c, [&](std::int64_t at, std::int64_t from, std::int64_t count) {
            if (at >= own && at < own + Sl) return;  // done first
            full.slice(0, at, count).copy_from(staged.slice(0, from, count));
            rows(at, count);
          });
          if (last && after_last) after_last();
        });
    P.after(gathered, task);
    P.after(previous, task);
  }
  stage.last_use = task;
  return task;
}

TaskId scatter_in_pieces(RankProgram& P, TaskId ready, TpOverlapStage& stage, const Tensor& full,
                         const Tensor& shard, const std::string& name,
                         const std::string& scatter_name, rt::TaskTags tags, const RowsCost& cost,
                         PieceRows rows) {
  const StepShape& z = P.shape;
  const TpPieces pieces = tp_scatter_pieces(z);
  const std::int64_t q = pieces.rows, n = q * z.t_sp;
  const Tensor staged = stage.buffer;
  TaskId task = ready, reduced = rt::kNoTask;
  for (int c = 0; c < pieces.count; ++c) {
    const TaskId previous = task;
    task = P.compute(fmt::format("{}.p{}", name, c), tags, cost(n), [=, &z] {
      for_each_range(z, pieces, c, [&](std::int64_t at, std::int64_t to, std::int64_t count) {
        rows(at, count);
        staged.slice(0, to, count).copy_from(full.slice(0, at, count));
      });
    });
    P.after(previous, task);
    P.after(stage.last_use, task);  // the stage's previous use has been reduced
    reduced = P.tensor.reduce_scatter(task, read_of(staged.slice(0, c * n, n)),
                                      all_of(shard.slice(0, c * q, q)),
                                      fmt::format("{}.p{}", scatter_name, c), tags);
  }
  stage.last_use = reduced;
  return reduced;
}

}  // namespace weave::graphs
