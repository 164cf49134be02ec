#include "weave/graphs/memory_timeline.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "weave/runtime/trace_metrics.hpp"

namespace weave::graphs {

std::int64_t MemoryTimeline::peak(std::size_t device, rt::MemoryCategory category) const {
  std::int64_t most = 0;
  for (const MemoryPoint& p : devices.at(device))
    most = std::max(most, p.bytes[static_cast<std::size_t>(category)]);
  return most;
}

std::int64_t MemoryTimeline::peak_total(std::size_t device) const {
  std::int64_t most = 0;
  for (const MemoryPoint& p : devices.at(device))
    most = std::max(most, std::accumulate(p.bytes.begin(), p.bytes.end(), std::int64_t{0}));
  return most;
}

MemoryTimeline memory_timeline(const std::vector<MemoryEvent>& events, const rt::Trace& trace,
                               std::size_t devices) {
  const rt::TraceMetrics metrics = rt::measure(trace);
  const rt::Nanos makespan = trace.empty() ? 0 : metrics.start + metrics.makespan;
  const std::size_t tasks = trace.empty() ? 0 : trace.tasks().size();
  // When an event's buffer is first held: the start of the next task built (the first one able
  // to use it); before every task, 0; past the last, or a task that never ran, the step's end.
  const auto when = [&](std::size_t built) -> rt::Nanos {
    if (built == 0) return 0;
    if (built >= tasks) return makespan;
    const rt::Span* span = trace.find(static_cast<rt::TaskId>(built));
    return span ? span->start : makespan;
  };
  std::vector<std::vector<std::pair<rt::Nanos, std::size_t>>> order(devices);
  for (std::size_t i = 0; i < events.size(); ++i) {
    const MemoryEvent& e = events[i];
    if (e.device >= devices)
      throw std::invalid_argument(fmt::format(
          "a memory event names device {}, the timeline has {} devices: give the device count of "
          "the set the step was built on",
          e.device, devices));
    order[e.device].emplace_back(when(e.tasks_built), i);
  }
  MemoryTimeline timeline;
  timeline.devices.resize(devices);
  for (std::size_t d = 0; d < devices; ++d) {
    // Stable: events at one time keep the order they were made in.
    std::stable_sort(order[d].begin(), order[d].end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<MemoryPoint>& points = timeline.devices[d];
    MemoryPoint held;
    points.push_back(held);
    for (const auto& [at, i] : order[d]) {
      held.at = at;
      held.bytes[static_cast<std::size_t>(events[i].category)] += events[i].bytes;
      points.push_back(held);
    }
    held.at = std::max(makespan, held.at);
    points.push_back(held);
  }
  return timeline;
}

}  // namespace weave::graphs
