#include "model/sequence_parallel.hpp"

#include <fmt/format.h>

namespace weave::graphs {

namespace {

// Runs `one(shard piece, full chunk, name, tags)` for each of the shard's sp_chunks() pieces: under
// Ampipe one per chunk.
template <typename Collective>
TaskId per_chunk(RankProgram& P, const Tensor& shard, const Tensor& full, const std::string& name,
                 rt::TaskTags tags, Collective one) {
  const int pieces = P.shape.sp_chunks();
  if (pieces == 1) return one(shard, full, name, tags);
  const std::int64_t piece = shard.dim(0) / pieces, chunk = full.dim(0) / pieces;
  TaskId last = rt::kNoTask;
  // A layer's pieces are its chunks' tasks, named and tagged as those are ("L3.c1.sp_gather");
  // the embedding's and the output's keep the piece as a suffix and no chunk.
  const std::size_t dot = name.find('.');
  for (int c = 0; c < pieces; ++c) {
    rt::TaskTags piece_tags = tags;
    std::string called = fmt::format("{}.c{}", name, c);
    if (dot != std::string::npos) {
      piece_tags.chunk = c;
      called = fmt::format("{}.c{}.{}", name.substr(0, dot), c, name.substr(dot + 1));
    }
    last =
        one(shard.slice(0, c * piece, piece), full.slice(0, c * chunk, chunk), called, piece_tags);
  }
  return last;
}

}  // namespace

TaskId sp_gather(RankProgram& P, TaskId ready, const Tensor& shard, const Tensor& full,
                 const std::string& name, rt::TaskTags tags) {
  return per_chunk(P, shard, full, name, tags,
                   [&](const Tensor& piece, const Tensor& chunk, const std::string& called,
                       rt::TaskTags piece_tags) {
                     return P.tensor.all_gather(ready, read_of(piece), all_of(chunk), called,
                                                piece_tags);
                   });
}

TaskId reduce_partial(RankProgram& P, TaskId ready, const Tensor& full, const Tensor& shard,
                      const std::string& name, rt::TaskTags tags) {
  if (!P.shape.sp())
    return P.tensor.all_reduce(ready, all_of(full), devices::ReduceOp::sum, name, tags);
  return per_chunk(P, shard, full, name, tags,
                   [&](const Tensor& piece, const Tensor& chunk, const std::string& called,
                       rt::TaskTags piece_tags) {
                     return P.tensor.reduce_scatter(ready, read_of(chunk), all_of(piece), called,
                                                    piece_tags);
                   });
}

}  // namespace weave::graphs
