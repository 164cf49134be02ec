// Small random graphs shaped like a training step's: tasks on several devices and streams,
// tagged with layer, micro-batch, chunk and phase, with data dependencies, events and collectives
// issued in the same order on every member. For properties that must hold on any graph.
#pragma once

#include <functional>
#include <random>
#include <vector>

#include "weave/runtime/graph.hpp"

namespace weave::rt::testing {

// Lets a test change a task's cost as it is added (a what-if built into the graph).
using CostEdit = std::function<CostHint(std::string_view stream, TaskKind kind, CostHint)>;

inline Graph random_step_graph(unsigned seed, int tasks_per_device = 20, int devices = 3,
                               const CostEdit& edit = {}) {
  std::mt19937 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  GraphBuilder b;
  const StreamId streams[] = {kComputeStream, b.stream("side"), b.stream("tp"), b.stream("ep")};
  const char* stream_names[] = {"compute", "side", "tp", "ep"};
  std::vector<TaskId> added;
  const EventId event = b.event("flag");
  std::uint64_t signals = 0;
  for (int i = 0; i < tasks_per_device; ++i) {
    // A collective every few rounds: one member per device, same order everywhere.
    if (i % 5 == 4) {
      const int s = 2 + pick(2);
      std::vector<TaskId> members;
      for (int d = 0; d < devices; ++d) {
        CostHint cost{.bytes = 16.0 * (1 + pick(50)), .messages = 1};
        if (edit) cost = edit(stream_names[s], TaskKind::comm, cost);
        const TaskId m = b.add({.device = static_cast<DeviceId>(d),
                                .stream = streams[s],
                                .kind = TaskKind::comm,
                                .tags = {.layer = pick(4), .micro_batch = pick(3)},
                                .cost = cost});
        if (!added.empty())
          b.precede(added[static_cast<std::size_t>(pick(static_cast<int>(added.size())))], m);
        members.push_back(m);
      }
      b.rendezvous("collective", members);
      added.insert(added.end(), members.begin(), members.end());
      continue;
    }
    for (int d = 0; d < devices; ++d) {
      const int s = pick(4);
      const TaskKind kind = s < 2 ? TaskKind::compute : TaskKind::comm;
      const double flops = 4.0 * pick(100);  // some take no time at all
      CostHint cost =
          kind == TaskKind::compute
              ? CostHint{.flops = flops, .attention_flops = static_cast<float>(flops / 2)}
              : CostHint{.bytes = 8.0 * (1 + pick(40)), .messages = 1};
      if (edit) cost = edit(stream_names[s], kind, cost);
      const TaskId t = b.add({.device = static_cast<DeviceId>(d),
                              .stream = streams[s],
                              .kind = kind,
                              .tags = {.layer = pick(4),
                                       .micro_batch = pick(3),
                                       .chunk = pick(2),
                                       .phase = static_cast<Phase>(pick(4))},
                              .cost = cost});
      for (int e = pick(3); e > 0 && !added.empty(); --e)
        b.precede(added[static_cast<std::size_t>(pick(static_cast<int>(added.size())))], t);
      if (pick(10) == 0)
        b.signal(t, event, ++signals);
      else if (signals > 0 && pick(10) == 0)
        b.wait(t, event, signals);
      added.push_back(t);
    }
  }
  return b.build();
}

}  // namespace weave::rt::testing
