// Gradient buckets reduced as soon as they are complete (with --overlap-grad-reduce; else after
// the backward), on the reducing group's stream: a
// bucket of sequence-parallel partials over tp first (on the tp group's gradient stream), then
// over its replicas (dp x cp for dense
// parameters, the expert-data-parallel group for experts); with the distributed optimizer the
// replicas reduce-scatter, each keeping its shard.
#pragma once

#include <string>

#include "step/rank_program.hpp"

namespace weave::graphs {

// Reduces every bucket of this rank whose name starts with `point` + "/" (a layer half, the
// final norm, the embeddings) after `after`; without ParallelPlan::overlap_grad_reduce a bucket
// with data-parallel replicas is only noted in P.deferred_buckets.
void reduce_buckets(RankProgram& P, const std::string& point, TaskId after);

// Reduces the deferred buckets, in the order they were noted, after the rank's last backward task
// (a task added last on the compute stream, after every task that completed one of them).
void reduce_deferred_buckets(RankProgram& P);

}  // namespace weave::graphs
