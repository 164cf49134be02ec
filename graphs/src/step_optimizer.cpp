// Gradient buckets reduced over data-parallel replicas, clipping and the (distributed) optimizer.
#include "training_step_impl.hpp"

namespace weave::graphs {

void TrainingStep::Impl::reduce_buckets(const std::string& point,
                                        const std::vector<TaskId>& after) {
  const rt::TaskTags tags{.phase = rt::Phase::backward};
  const auto& buckets = ranks[stage_rank()].shard->buckets();
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const GradientBucket& b0 = buckets[i];
    if (b0.name.rfind(point + "/", 0) != 0) continue;
    auto grads = [this, i](int r) { return ranks[r].shard->buckets()[i].grads; };
    std::vector<TaskId> ready = after;
    auto reduce = [&](GroupKind kind, const std::string& suffix) {
      auto ids =
          all_reduce_over(kind, ready, grads, devices::ReduceOp::sum, b0.name + suffix, tags, true);
      for (std::size_t r = 0; r < ids.size(); ++r)
        if (ids[r] != rt::kNoTask) ready[r] = ids[r];
    };
    if (b0.reduction == GradientReduction::tensor_partial) reduce(GroupKind::tensor, ".tp");
    const GroupKind replicas = b0.expert ? GroupKind::expert_data : GroupKind::data_context;
    if (!b0.sharded) {
      reduce(replicas, ".dp");
      continue;
    }
    // Distributed optimizer: each replica receives only its shard, reduced.
    per_group(
        replicas, ready,
        [&](const devices::ProcessGroup& g) {
          std::vector<std::span<const float>> in;
          std::vector<std::span<float>> out;
          for (rt::DeviceId dv : g.devices()) {
            const GradientBucket& bk = ranks[dv].shard->buckets()[i];
            in.emplace_back(bk.grads.data(), static_cast<std::size_t>(bk.grads.numel()));
            out.emplace_back(bk.grads.data() + bk.shard_begin,
                             static_cast<std::size_t>(bk.shard_size));
          }
          return comm.reduce_scatter(
              b, g, in, out, devices::ReduceOp::sum,
              {.name = b0.name + ".dp", .tags = tags, .stream = "grad_comm"});
        },
        true);
  }
}

void TrainingStep::Impl::build_optimizer() {
  const rt::TaskTags tags{.phase = rt::Phase::weight};
  auto norm = each("grad_norm", tags, [this](int r) {
    // Each distinct gradient element once: tensor-parallel copies on tp rank 0 only, data-
    // parallel copies on the replica that owns the element (its shard, or replica 0).
    const bool tp_first = mesh.coordinates(r).tp == 0;
    // The output layer's copy of the word embedding counts on the first stage only.
    const Parameter* copy =
        ranks[r].shard->holds_embedding_copy() ? &ranks[r].shard->embedding() : nullptr;
    double sum = 0;
    for (const GradientBucket& bucket : ranks[r].shard->buckets()) {
      if (!bucket.sharded && bucket.replica != 0) continue;
      const std::int64_t lo = bucket.shard_begin, hi = lo + bucket.shard_size;
      std::int64_t at = 0;
      for (const Parameter* p : bucket.params) {
        const std::int64_t n = p->grad.numel();
        const std::int64_t from = std::max(at, lo), to = std::min(at + n, hi);
        if (from < to && p != copy && (!p->tensor_replicated || tp_first)) {
          const float* g = bucket.grads.data();
          for (std::int64_t e = from; e < to; ++e)
            sum += static_cast<double>(g[e]) * g[e];
        }
        at += n;
      }
    }
    ranks[r].norm_sq.data()[0] = static_cast<float>(sum);
  });
  // Everything the comm streams reduced must be in before the norm is taken.
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    if (last_comm[r] != rt::kNoTask) b.precede(last_comm[r], norm[r]);
    if (last_grad[r] != rt::kNoTask) b.precede(last_grad[r], norm[r]);
  }
  std::vector<TaskId> summed(ranks.size(), rt::kNoTask);
  if (ranks.size() > 1) {
    std::vector<rt::DeviceId> all(ranks.size());
    std::iota(all.begin(), all.end(), 0u);
    const devices::ProcessGroup world("world", all);
    std::vector<std::span<float>> bufs;
    for (auto& R : ranks)
      bufs.push_back(all_of(R.norm_sq));
    summed = comm.all_reduce(b, world, bufs, devices::ReduceOp::sum,
                             {.name = "grad_norm_sum", .tags = tags});
    link(norm, summed);
  }
  auto step = each("optimizer", tags, [this](int r) {
    if (!update) return;
    const double norm = std::sqrt(static_cast<double>(ranks[r].norm_sq.data()[0]));
    const double coef = opt.clip_grad > 0 ? ops::clip_coefficient(norm, opt.clip_grad) : 1.0;
    ops::AdamWOptions o = opt.adamw;
    o.lr = learning_rate;
    for (GradientBucket& bucket : ranks[r].shard->buckets()) {
      // The elements this device updates: its shard, or the whole bucket.
      const Tensor grads = bucket.grads.slice(0, bucket.shard_begin, bucket.shard_size);
      if (coef < 1.0) {
        float* g = grads.data();
        for (std::int64_t i = 0; i < grads.numel(); ++i)
          g[i] *= static_cast<float>(coef);
      }
      ops::adamw_step(o, iteration, bucket.values.slice(0, bucket.shard_begin, bucket.shard_size),
                      grads, bucket.exp_avg, bucket.exp_avg_sq);
    }
  });
  link(summed, step);
  // Distributed optimizer: each replica updated its shard; gather the whole values back.
  if (!plan.distributed_optimizer) return;
  for (stage_ = 0; stage_ < plan.pipeline_parallel; ++stage_) {
    const auto& buckets = ranks[stage_rank()].shard->buckets();
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      if (!buckets[i].sharded) continue;
      per_group(buckets[i].expert ? GroupKind::expert_data : GroupKind::data_context, step,
                [&](const devices::ProcessGroup& g) {
                  std::vector<std::span<const float>> in;
                  std::vector<std::span<float>> out;
                  for (rt::DeviceId dv : g.devices()) {
                    const GradientBucket& bk = ranks[dv].shard->buckets()[i];
                    in.emplace_back(bk.values.data() + bk.shard_begin,
                                    static_cast<std::size_t>(bk.shard_size));
                    out.push_back(all_of(bk.values));
                  }
                  return comm.all_gather(b, g, in, out,
                                         {.name = buckets[i].name + ".gather", .tags = tags});
                });
    }
  }
  stage_ = -1;
}

}  // namespace weave::graphs
