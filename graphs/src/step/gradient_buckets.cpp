#include "step/gradient_buckets.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "step/step_costs.hpp"
#include "weave/ops/elementwise.hpp"

namespace weave::graphs {

namespace {

// Before a bucket's data-parallel collective, on the compute stream: its gradients checked for
// NaN and infinities, then scaled by 1 / the replicas (cost::pre_reduction_passes). The check is
// real: a non-finite gradient stops the step here, as Megatron-Core's check_grads does on its
// main branch (NaN and infinity; core_v0.8.0 asserted on NaN only), unless a loss scaler owns
// overflows (it skips such steps; Megatron-LM turns the check off under dynamic loss scaling).
// weave's gradients are averaged elsewhere, so only the scaling's price is Megatron's.
TaskId add_pre_reduction_passes(RankProgram& P, GradientBucket& bucket, int replicas,
                                double gradient_bytes, TaskId ready) {
  const bool checked = !P.opt.loss_scaling;
  GradientBucket* b = &bucket;
  const TaskId passes = P.compute(
      bucket.name + ".check", {.phase = rt::Phase::backward},
      cost::pre_reduction_passes(static_cast<double>(bucket.grads.numel()), gradient_bytes, checked,
                                 replicas),
      [b, checked] {
        if (!checked) return;
        const float* g = b->grads.data();
        const std::int64_t n = b->grads.numel();
        // One branch-free pass over every step's gradients (it vectorises); the rare failure
        // then looks for the value to name.
        bool finite = true;
        for (std::int64_t i = 0; i < n; ++i)
          finite &= std::isfinite(g[i]);
        if (finite) return;
        for (std::int64_t i = 0; i < n; ++i)
          if (!std::isfinite(g[i]))
            throw std::runtime_error(fmt::format(
                "gradient bucket '{}' holds a non-finite gradient ({}) before its data-parallel "
                "reduction (Megatron-Core's check_for_nan_in_grad stops the run here): lower "
                "the learning rate, or train with a loss scaler (--fp16), which skips such steps",
                b->name, g[i]));
      });
  P.after(ready, passes);
  return passes;
}

// Reduces bucket b of this rank's shard after `ready`: its sequence-parallel partials over tp,
// then its replicas.
void reduce_bucket(RankProgram& P, GradientBucket& bucket, TaskId ready) {
  const rt::TaskTags tags{.phase = rt::Phase::backward};
  // The gradients are reduced in the precision they are accumulated in (ParameterBytes).
  const auto gradient_bytes =
      static_cast<std::size_t>(parameter_bytes(P.shape.model.precision).gradient);
  const GroupHandle tensor = P.tensor_gradients.with_element_bytes(gradient_bytes);
  const GroupHandle data = P.data.with_element_bytes(gradient_bytes);
  const GroupHandle expert_data = P.expert_data.with_element_bytes(gradient_bytes);
  auto chain = [&ready](TaskId reduced) {
    if (reduced != rt::kNoTask) ready = reduced;
  };
  const GroupHandle& replicas = bucket.expert ? expert_data : data;
  if (bucket.held_grads.defined()) {
    // Stage 2 under a zero-bubble schedule: the I actions' gradients, held aside until the bucket
    // took its slot, moved in (and the held ones zeroed for the next I), on the compute stream
    // behind the tasks that completed the bucket.
    GradientBucket* b = &bucket;
    const TaskId moved = P.compute(
        bucket.name + ".held", tags,
        cost::streamed_bytes(3 * static_cast<double>(bucket.held_grads.numel()),
                             static_cast<double>(gradient_bytes)),
        [b] {
          for (const GradientBucket::HeldRange& r : b->held_at)
            b->grads.slice(0, r.at, r.size).copy_from(b->held_grads.slice(0, r.held, r.size));
          b->held_grads.fill(0.f);
        });
    P.after(ready, moved);
    ready = moved;
  }
  if (!bucket.staged && replicas.size() > 1)
    ready = add_pre_reduction_passes(P, bucket, replicas.size(),
                                     static_cast<double>(gradient_bytes), ready);
  if (bucket.reduction == GradientReduction::tensor_partial)
    chain(tensor.all_reduce(ready, all_of(bucket.grads), devices::ReduceOp::sum,
                            bucket.name + ".tp", tags));
  if (!bucket.sharded) {
    replicas.all_reduce(ready, all_of(bucket.grads), devices::ReduceOp::sum, bucket.name + ".dp",
                        tags);
    return;
  }
  // Distributed optimizer: each replica receives only its shard, reduced.
  const TaskId scattered =
      replicas.reduce_scatter(ready, read_of(bucket.grads),
                              all_of(bucket.grads.slice(0, bucket.shard_begin, bucket.shard_size)),
                              bucket.name + ".dp", tags);
  if (!bucket.staged) return;
  // ZeRO stage 2: the reduced shard is added to the step's, and the slot's part zeroed for the
  // next layer to take it, on the replicas' stream behind the reduction (DeepSpeed's stage 2
  // copies each reduced partition out of its bucket likewise, before the bucket is reused).
  GradientBucket* b = &bucket;
  const auto gradient_bytes_d = static_cast<double>(gradient_bytes);
  const double shard = static_cast<double>(bucket.shard_size);
  const rt::CostHint cost =
      cost::streamed_bytes(3 * shard + static_cast<double>(bucket.grads.numel()), gradient_bytes_d);
  const TaskId accumulated = P.compute_on(
      replicas.stream(), bucket.expert ? CommGroup::expert_data : CommGroup::data_context,
      bucket.name + ".accumulate", tags, cost, [b] {
        ops::accumulate(b->grads.slice(0, b->shard_begin, b->shard_size), b->grad_shard);
        b->grads.fill(0.f);
      });
  P.after(scattered, accumulated);
  P.gradient_slot_releases[bucket.slot].push_back(accumulated);
}

// Megatron-LM's default --delay-grad-reduce (its --no-delay-grad-reduce turns it off; weave has
// no such switch): under the 1F1B schedule without virtual stages only the first pipeline stage
// starts its buckets' reductions as the last micro-batch's backward completes them; the later
// stages start them all after their last backward (grad_sync_func, after the cooldown's sends),
// in the bubble while the earlier stages finish theirs. megatron/training/training.py lines
// 1001-1002 and megatron/core/pipeline_parallel/schedules.py lines 1460-1464 and 1480-1503 at
// core_v0.8.0 ("Other pipeline stages do grad reduction during pipeline bubble").
bool delays_reduction(const RankProgram& P) {
  const ParallelPlan& plan = P.shape.plan;
  const bool one_f_one_b = plan.pipeline_scheduler.empty() || plan.pipeline_scheduler == "1f1b";
  return plan.pipeline_parallel > 1 && plan.virtual_pipeline == 1 && one_f_one_b && P.at.pp != 0;
}

}  // namespace

void reduce_buckets(RankProgram& P, const std::string& point, TaskId after, bool last) {
  std::vector<GradientBucket>& buckets = P.shard().buckets();
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    GradientBucket& bucket = buckets[b];
    if (bucket.name.rfind(point + "/", 0) != 0) continue;
    // A staged bucket (ZeRO stage 2) is reduced after every micro-batch, at once: its slot is
    // taken by the next layers. The others accumulate over the micro-batches first.
    if (bucket.staged) {
      reduce_bucket(P, bucket, after);
      continue;
    }
    if (!last) continue;
    const GroupHandle& replicas = bucket.expert ? P.expert_data : P.data;
    // Without --overlap-grad-reduce a bucket that has replicas to reduce with waits, with its
    // tensor-parallel partials, for the end of the backward (Megatron-LM's finish_grad_sync).
    // So does it with the overlap on a pipeline stage after the first under the 1F1B schedule
    // (delays_reduction).
    if ((!P.shape.plan.overlap_grad_reduce || delays_reduction(P)) && replicas.size() > 1)
      P.deferred_buckets.emplace_back(b, after);
    else
      reduce_bucket(P, bucket, after);
  }
}

void wait_for_gradient_slot(RankProgram& P, int layer, const rt::TaskTags& tags) {
  const int slot = P.shard().gradient_slot(layer);
  if (slot < 0) return;
  std::vector<TaskId>& releases = P.gradient_slot_releases[slot];
  if (releases.empty()) return;
  // On the compute stream, whose tasks run in the order they were added: every later task, the
  // layer's gradient writes among them, waits for the slot's previous layer to be reduced.
  const TaskId free = P.graph.add({.device = static_cast<rt::DeviceId>(P.rank),
                                   .stream = rt::kComputeStream,
                                   .kind = rt::TaskKind::host,
                                   .name = "grad_slot_wait",
                                   .tags = tags},
                                  [](rt::TaskContext&) {});
  for (const TaskId release : releases)
    P.after(release, free);
  releases.clear();
}

void reduce_deferred_buckets(RankProgram& P) {
  if (P.deferred_buckets.empty()) return;
  // Last on the compute stream, whose tasks run in the order they were added: after every
  // backward task of the step, and after the tasks that completed each bucket. A host task: it
  // marks the point and costs nothing.
  const TaskId backward_done = P.graph.add({.device = static_cast<rt::DeviceId>(P.rank),
                                            .stream = rt::kComputeStream,
                                            .kind = rt::TaskKind::host,
                                            .name = "grad_sync_start",
                                            .tags = {.phase = rt::Phase::backward}},
                                           [](rt::TaskContext&) {});
  for (const auto& [bucket, after] : P.deferred_buckets)
    P.after(after, backward_done);
  for (const auto& [bucket, after] : P.deferred_buckets)
    reduce_bucket(P, P.shard().buckets()[bucket], backward_done);
  P.deferred_buckets.clear();
}

}  // namespace weave::graphs
