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
// A staged bucket (ZeRO stage 2) is reduced on every micro-batch, the others on the `last` only.
void reduce_buckets(RankProgram& P, const std::string& point, TaskId after, bool last = true);

// ZeRO stage 2: before layer `layer`'s backward writes its gradients, a task on the compute stream
// that waits for the reductions of the layers that used its gradient slot before.
void wait_for_gradient_slot(RankProgram& P, int layer, const rt::TaskTags& tags);

// Reduces the deferred buckets, in the order they were noted, after the rank's last backward task
// (a task added last on the compute stream, after every task that completed one of them).
void reduce_deferred_buckets(RankProgram& P);

}  // namespace weave::graphs
