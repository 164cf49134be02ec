// Replays a graph in simulated time: each task lasts what a cost model says, under the same
// dependency and stream rules as the executor. Gives the timeline real accelerators would
// show, exactly and repeatably, whatever the host; and with the work skipped it replays
// graphs of millions of tasks in seconds.
#pragma once

#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/fault_plan.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::rt {

struct VirtualClockOptions {
  // Also run each task's work, one at a time in simulated start order, on the calling thread.
  bool execute = false;
  // A device has one compute engine: compute tasks on different streams of a device queue
  // for it (earliest ready first, then lowest task id). Off: streams compute in parallel.
  bool one_compute_engine_per_device = true;
  // Record the trace (off saves memory on huge graphs; the makespan is returned anyway).
  bool record_trace = true;
  // Test hook: faults to inject (FaultPoint::run counts this clock's runs from 0). A task hit by
  // throw_error fails the replay, whether or not it executes the work; a task that never arrives
  // leaves the tasks waiting for it unrun, and the replay fails naming them. Must outlive the
  // clock.
  const FaultPlan* faults = nullptr;
};

struct VirtualRunResult {
  Nanos makespan = 0;
  Trace trace;
};

class VirtualClock {
 public:
  explicit VirtualClock(const CostModel& model, VirtualClockOptions options = {});
  // Throws TaskError if a task's work fails (execute mode), a fault plan's task throws, or the
  // replay ends with tasks that never ran (a collective member the fault plan held back).
  VirtualRunResult run(const Graph& graph);

 private:
  const CostModel& model_;
  VirtualClockOptions options_;
  std::uint64_t runs_ = 0;
};

}  // namespace weave::rt
