// A trace's spans by task and the graph's predecessors of each task: what a walk back along a
// critical path reads, on the virtual clock (critical_path.cpp) and on the wall clock
// (wall_critical_path.cpp).
#pragma once

#include <vector>

#include "weave/runtime/critical_path.hpp"

namespace weave::rt {

struct TracedPredecessor {
  TaskId task;
  EdgeKind kind;
};

struct TraceTimes {
  std::vector<Nanos> start;  // -1 where the trace has no span of the task
  std::vector<Nanos> end;
  std::vector<std::vector<TracedPredecessor>> predecessors;

  bool ran(TaskId t) const { return end[t] >= 0; }
};

// The caller has checked that `trace` is of `graph` (as many tasks) on the clock it walks.
inline TraceTimes read_trace_times(const Graph& graph, const Trace& trace) {
  const std::size_t n = graph.tasks().size();
  TraceTimes times{std::vector<Nanos>(n, -1), std::vector<Nanos>(n, -1),
                   std::vector<std::vector<TracedPredecessor>>(n)};
  for (const Span& s : trace.spans()) {
    times.start[s.task] = s.start;
    times.end[s.task] = s.end;
  }
  for (TaskId t = 0; t < n; ++t) {
    const auto succ = graph.successors(t);
    const auto kinds = graph.successor_kinds(t);
    for (std::size_t i = 0; i < succ.size(); ++i)
      times.predecessors[succ[i]].push_back({t, kinds[i]});
  }
  return times;
}

// How a step waited for a predecessor joined to it by an edge of this kind.
inline CriticalLink link_of(EdgeKind kind) {
  switch (kind) {
    case EdgeKind::explicit_dependency:
      return CriticalLink::dependency;
    case EdgeKind::stream_order:
      return CriticalLink::stream_order;
    case EdgeKind::event:
      return CriticalLink::event;
  }
  return CriticalLink::dependency;
}

}  // namespace weave::rt
