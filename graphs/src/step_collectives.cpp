// The step's collectives over the mesh's groups: tensor-parallel all-reduce, sequence parallelism's
// gather and scatter.
#include "training_step_impl.hpp"

namespace weave::graphs {

std::vector<TaskId> TrainingStep::Impl::per_group(GroupKind kind,
                                                  const std::vector<TaskId>& producers,
                                                  const GroupCall& call, bool gradient_stream) {
  std::vector<TaskId> members(ranks.size(), rt::kNoTask);
  for (const auto& g : mesh.groups(kind)) {
    if (g.size() == 1 || !in_stage(static_cast<int>(g.device(0)))) continue;
    const auto ids = call(g);
    for (int i = 0; i < g.size(); ++i) {
      const int r = static_cast<int>(g.device(i));
      members[r] = ids[i];
      if (producers[r] != rt::kNoTask) b.precede(producers[r], ids[i]);
      (gradient_stream ? last_grad : last_comm)[r] = ids[i];
    }
  }
  return members;
}

std::vector<TaskId> TrainingStep::Impl::all_reduce_over(
    GroupKind kind, const std::vector<TaskId>& producers, std::function<Tensor(int)> buffer,
    devices::ReduceOp op, const std::string& name, rt::TaskTags tags, bool gradient_stream) {
  return per_group(
      kind, producers,
      [&](const devices::ProcessGroup& g) {
        std::vector<std::span<float>> bufs;
        for (rt::DeviceId dv : g.devices())
          bufs.push_back(all_of(buffer(static_cast<int>(dv))));
        return comm.all_reduce(
            b, g, bufs, op,
            {.name = name, .tags = tags, .stream = gradient_stream ? "grad_comm" : "comm"});
      },
      gradient_stream);
}

std::vector<TaskId> TrainingStep::Impl::tp_all_reduce(const std::vector<TaskId>& producers,
                                                      std::function<Tensor(int)> buffer,
                                                      devices::ReduceOp op, const std::string& name,
                                                      rt::TaskTags tags) {
  return all_reduce_over(GroupKind::tensor, producers, std::move(buffer), op, name, tags);
}

std::vector<TaskId> TrainingStep::Impl::tp_all_gather(const std::vector<TaskId>& producers,
                                                      std::function<Tensor(int)> shard,
                                                      std::function<Tensor(int)> full,
                                                      const std::string& name, rt::TaskTags tags) {
  return per_group(GroupKind::tensor, producers, [&](const devices::ProcessGroup& g) {
    std::vector<std::span<const float>> in;
    std::vector<std::span<float>> out;
    for (rt::DeviceId dv : g.devices()) {
      const Tensor s = shard(static_cast<int>(dv));
      in.emplace_back(s.data(), static_cast<std::size_t>(s.numel()));
      out.push_back(all_of(full(static_cast<int>(dv))));
    }
    return comm.all_gather(b, g, in, out, {.name = name, .tags = tags});
  });
}

std::vector<TaskId> TrainingStep::Impl::tp_reduce_scatter(const std::vector<TaskId>& producers,
                                                          std::function<Tensor(int)> full,
                                                          std::function<Tensor(int)> shard,
                                                          const std::string& name,
                                                          rt::TaskTags tags) {
  return per_group(GroupKind::tensor, producers, [&](const devices::ProcessGroup& g) {
    std::vector<std::span<const float>> in;
    std::vector<std::span<float>> out;
    for (rt::DeviceId dv : g.devices()) {
      const Tensor s = full(static_cast<int>(dv));
      in.emplace_back(s.data(), static_cast<std::size_t>(s.numel()));
      out.push_back(all_of(shard(static_cast<int>(dv))));
    }
    return comm.reduce_scatter(b, g, in, out, devices::ReduceOp::sum, {.name = name, .tags = tags});
  });
}

std::vector<TaskId> TrainingStep::Impl::reduce_partial(const std::vector<TaskId>& producers,
                                                       std::function<Tensor(int)> full,
                                                       std::function<Tensor(int)> shard,
                                                       const std::string& name, rt::TaskTags tags) {
  if (t_sp > 1) return tp_reduce_scatter(producers, full, shard, name, tags);
  return tp_all_reduce(producers, full, devices::ReduceOp::sum, name, tags);
}

}  // namespace weave::graphs
