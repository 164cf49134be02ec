#include "model/sequence_parallel.hpp"

#include <fmt/format.h>

namespace weave::graphs {

namespace {

// Runs `one(shard piece, full chunk, name)` for each of the shard's sp_chunks() pieces.
template <typename Collective>
TaskId per_chunk(RankProgram& P, const Tensor& shard, const Tensor& full, const std::string& name,
                 Collective one) {
  const int pieces = P.shape.sp_chunks();
  if (pieces == 1) return one(shard, full, name);
  const std::int64_t piece = shard.dim(0) / pieces, chunk = full.dim(0) / pieces;
  TaskId last = rt::kNoTask;
  for (int c = 0; c < pieces; ++c)
    last = one(shard.slice(0, c * piece, piece), full.slice(0, c * chunk, chunk),
               fmt::format("{}.c{}", name, c));
  return last;
}

}  // namespace

TaskId sp_gather(RankProgram& P, TaskId ready, const Tensor& shard, const Tensor& full,
                 const std::string& name, rt::TaskTags tags) {
  return per_chunk(P, shard, full, name,
                   [&](const Tensor& piece, const Tensor& chunk, const std::string& called) {
                     return P.tensor.all_gather(ready, read_of(piece), all_of(chunk), called, tags);
                   });
}

TaskId reduce_partial(RankProgram& P, TaskId ready, const Tensor& full, const Tensor& shard,
                      const std::string& name, rt::TaskTags tags) {
  if (!P.shape.sp())
    return P.tensor.all_reduce(ready, all_of(full), devices::ReduceOp::sum, name, tags);
  return per_chunk(P, shard, full, name,
                   [&](const Tensor& piece, const Tensor& chunk, const std::string& called) {
                     return P.tensor.reduce_scatter(ready, read_of(chunk), all_of(piece), called,
                                                    tags);
                   });
}

}  // namespace weave::graphs
