// The chain of tasks that sets a step's time on the virtual clock, and what-if replays.
//
// Walking back from the task that ends last, each task on the path started when the one before
// it ended: a predecessor in the graph (a data dependency, the previous task on its stream, or an
// event), the last member of its collective to arrive, or the task that held its device's compute
// engine. The path's steps tile the replay from 0 to the makespan, so their durations sum to the
// step time exactly, and each step's share says how much of the step it accounts for.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::rt {

// Why a step of the path started when it did: what it waited for.
enum class CriticalLink : std::uint8_t {
  start,         // nothing: it began the step at time 0
  dependency,    // a data dependency (an explicit edge)
  stream_order,  // the previous task on its stream
  event,         // an event another task signalled
  collective,    // the last member of its collective to arrive
  engine,        // its device's compute engine, busy with another stream's compute
};
std::string_view to_string(CriticalLink link);

struct CriticalStep {
  TaskId task = kNoTask;
  // For a collective: the member whose arrival started it (task is the member on the path's
  // device, the one its successor on the path waits for); else the task itself.
  TaskId last_member = kNoTask;
  Nanos begin = 0;  // a collective begins when its last member arrives
  Nanos end = 0;
  CriticalLink waited_for = CriticalLink::start;  // how this step was reached from the one before
};

struct CriticalPath {
  std::vector<CriticalStep> steps;  // in time order, contiguous from 0 to `length`
  Nanos length = 0;

  // The path's tasks in order, a collective's last member before the member on the path (what
  // DotOptions::critical_path takes).
  std::vector<TaskId> tasks() const;
};

// The critical path of a virtual-clock replay of `graph` (VirtualClock with record_trace).
// Throws std::invalid_argument if the trace is not the graph's virtual-clock trace.
CriticalPath critical_path(const Graph& graph, const Trace& trace);

// Time on the path by what the steps are: "compute", "<stream> communication" for each stream
// that moves data (a process group's, or the pipeline's p2p streams), "host"; and by what each
// step waited for. Largest first.
struct PathShare {
  std::string what;
  Nanos time = 0;
};
struct CriticalPathSummary {
  std::vector<PathShare> by_kind;
  std::vector<PathShare> by_wait;
};
CriticalPathSummary summarize(const CriticalPath& path, const TaskTable& tasks);

}  // namespace weave::rt
