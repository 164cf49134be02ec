#include "weave/runtime/cost_model.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

namespace weave::rt {

UniformCostModel::UniformCostModel(double flops_per_second, Nanos latency, double bytes_per_second)
    : flops_per_second_(flops_per_second), latency_(latency), bytes_per_second_(bytes_per_second) {
  if (!(flops_per_second > 0) || !(bytes_per_second > 0) || latency < 0) {
    throw std::invalid_argument(fmt::format(
        "a cost model needs a positive compute rate and bandwidth and a latency >= 0 (got {} "
        "FLOP/s, {} B/s, {} ns)",
        flops_per_second, bytes_per_second, latency));
  }
}

Nanos UniformCostModel::duration(const TaskTable& tasks, TaskId task, const CostHint& cost) const {
  const TaskInfo& t = tasks[task];
  switch (t.kind) {
    case TaskKind::compute:
      return static_cast<Nanos>(std::llround(cost.flops / flops_per_second_ * 1e9));
    case TaskKind::comm:
    case TaskKind::copy: {
      const auto messages = cost.messages > 0 ? cost.messages : (cost.bytes > 0 ? 1u : 0u);
      return static_cast<Nanos>(messages) * latency_ +
             static_cast<Nanos>(std::llround(cost.bytes / bytes_per_second_ * 1e9));
    }
    case TaskKind::host:
      return 0;
  }
  return 0;
}

}  // namespace weave::rt
