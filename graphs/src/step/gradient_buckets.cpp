#include "step/gradient_buckets.hpp"

#include "step/step_costs.hpp"
#include "weave/ops/elementwise.hpp"

namespace weave::graphs {

namespace {

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
  if (bucket.reduction == GradientReduction::tensor_partial)
    chain(tensor.all_reduce(ready, all_of(bucket.grads), devices::ReduceOp::sum,
                            bucket.name + ".tp", tags));
  const GroupHandle& replicas = bucket.expert ? expert_data : data;
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
    if (!P.shape.plan.overlap_grad_reduce && replicas.size() > 1)
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
