// Sequence parallelism's two collectives over the tensor-parallel group, for the shard layout of
// StepShape: with chunk-major shards (Ampipe under SP) each runs once per chunk, moving the tp
// ranks' pieces c to and from the contiguous rows of chunk c, so the whole-sequence tensors stay
// in the rank's sequence order whatever the shards hold.
#pragma once

#include <string>

#include "step/rank_program.hpp"

namespace weave::graphs {

// Every tp rank's shard ([Sl, ...], sequence-major) into the rank's whole sequence `full`
// ([Sc, ...]). Returns the last collective (they keep the tp stream's order), or kNoTask for a
// group of one.
TaskId sp_gather(RankProgram& P, TaskId ready, const Tensor& shard, const Tensor& full,
                 const std::string& name, rt::TaskTags tags);

// g-bar in forward: the partial sums `full` reduce-scattered into `shard` under SP, all-reduced
// in place otherwise (the shard is the buffer). kNoTask without tensor parallelism.
TaskId reduce_partial(RankProgram& P, TaskId ready, const Tensor& full, const Tensor& shard,
                      const std::string& name, rt::TaskTags tags);

}  // namespace weave::graphs
