// The chain of tasks that sets a step's time, on the virtual clock (exact) and on the wall clock
// (from a run's recorded spans).
//
// Walking back from the task that ends last, each task on the path started when the one before
// it ended: a predecessor in the graph (a data dependency, the previous task on its stream, or an
// event), the last member of its collective to arrive, or the task that held its device's compute
// engine. The path's steps tile the replay from 0 to the makespan, so their durations sum to the
// step time exactly, and each step's share says how much of the step it accounts for.
//
// On the wall clock a task starts some time after what it waited for ended: the host took that
// long to hand it to a thread (scheduling, a thread waking, a kernel's launch). The walk takes, at
// each step, the predecessor that ended last (a graph predecessor of the task, or of its
// collective's last member, or the task that ran before it on its device) and counts the gap as
// the step's wait; the steps and their waits tile the run from its first task's start to its last
// task's end.
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
  device,        // wall clock: the task that ran before it on its device, ending last
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
  // Wall clock: the time between the step before ending (the run's first start, for the first
  // step) and this one beginning, which the host spent handing the task to a thread. 0 on the
  // virtual clock.
  Nanos waited = 0;
};

struct CriticalPath {
  // In time order, contiguous from `start` to `start + length` (on the wall clock with each
  // step's wait before it).
  std::vector<CriticalStep> steps;
  Nanos length = 0;
  Nanos start = 0;  // 0 on the virtual clock; the run's first task's start on the wall clock
  ClockKind clock = ClockKind::virtual_time;

  // The path's tasks in order, a collective's last member before the member on the path (what
  // DotOptions::critical_path takes).
  std::vector<TaskId> tasks() const;
};

// The critical path of a virtual-clock replay of `graph` (VirtualClock with record_trace).
// Throws std::invalid_argument if the trace is not the graph's virtual-clock trace.
CriticalPath critical_path(const Graph& graph, const Trace& trace);

// The critical path of a run of `graph` on the wall clock (RunOptions::record_trace): its length
// is the run's span, from the first task's start to the last task's end. Tasks without a span
// (not run here, or cancelled) are left out. Throws std::invalid_argument if the trace is not a
// wall-clock trace of the graph.
CriticalPath wall_critical_path(const Graph& graph, const Trace& trace);

// Time on the path by what the steps are: "compute", "<stream> communication" for each stream
// that moves data (a process group's, or the pipeline's p2p streams), "host", and on the wall
// clock kWallWait for the steps' waits; and by what each step waited for (the waits again under
// kWallWait). Largest first; each list sums to the path's length.
struct PathShare {
  std::string what;
  Nanos time = 0;
};
inline constexpr std::string_view kWallWait = "waits: host scheduling and launch";
struct CriticalPathSummary {
  std::vector<PathShare> by_kind;
  std::vector<PathShare> by_wait;
};
CriticalPathSummary summarize(const CriticalPath& path, const TaskTable& tasks);

}  // namespace weave::rt
