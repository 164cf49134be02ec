// Runs graphs on the devices' oneTBB arenas, on the wall clock.
//
// Guarantees: a task starts after everything it depends on has completed; at most one task
// runs at a time on a (device, stream); no worker thread ever blocks waiting for another task,
// so any number of devices can share one thread; the calling thread helps run the work.
// A task that throws cancels the run: tasks not yet started are skipped, tasks deferred are
// abandoned, and run() throws TaskError naming the task once nothing is running any more.
#pragma once

#include <memory>

#include <tbb/task_arena.h>
#include <mutex>
#include <string_view>
#include <vector>

#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/fault_plan.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::rt {

class Event;
class Stream;

namespace detail {
class DeviceQueues;
class RunState;
class Timer;
class EagerRegistry;
}  // namespace detail

struct RunOptions {
  // Record a span per task (costs two clock reads per task).
  bool record_trace = false;
  // When set, a comm or copy task completes no earlier than its modelled duration after it
  // began (for a rendezvous: after the last member arrived), held by a timer thread.
  const CostModel* link_model = nullptr;
  // Stall watchdog: a run in which no task runs and nothing completes for this long (what is
  // left waits for deferred completions, for collective members that never arrive, or for tasks
  // a fault plan held back) is cancelled with an error naming what waited: the deferred tasks,
  // each collective with the members that arrived and those that did not. 0 disables.
  Nanos stall_timeout = 60'000'000'000;
  // A run not finished this long after it began is cancelled as if a task had failed: tasks not
  // yet started are skipped, deferred ones abandoned, and run() throws a TaskError naming what
  // was outstanding once the tasks already running have returned (a task's work is never cut
  // short). 0: no deadline.
  Nanos deadline = 0;
};

struct RunResult {
  Nanos wall_time = 0;
  Trace trace;  // empty unless RunOptions::record_trace
};

class Executor {
 public:
  // One arena per device, indexed by DeviceId. The arenas must outlive the executor.
  explicit Executor(std::vector<tbb::task_arena*> arenas);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  std::size_t device_count() const;

  // Runs the graph once. Runs on one executor are serialised. Throws GraphError if a task is
  // placed on a device this executor lacks, TaskError if a task failed.
  RunResult run(const Graph& graph, const RunOptions& options = {});

  // Test hook: injects the plan's faults into the runs that follow (FaultPoint::run counts from
  // the next run, 0). An empty plan stops injecting. Not for a run in progress.
  void set_fault_plan(FaultPlan plan);

  // Eager mode, for programs that do not build graphs: work enqueued on a stream runs in
  // order on the stream's device.
  Stream stream(DeviceId device, StreamId stream = kComputeStream);
  Stream stream(DeviceId device, std::string_view name);
  // Blocks the calling thread, helping run queued work, until the event reaches value.
  // Throws TaskError if the event failed (a stream that would signal it failed first).
  void wait(const Event& event, std::uint64_t value);
  // Eager tasks are traced between these two calls.
  void begin_eager_trace();
  Trace end_eager_trace();

 private:
  std::shared_ptr<detail::DeviceQueues> queues_;
  std::unique_ptr<detail::Timer> timer_;
  std::shared_ptr<detail::EagerRegistry> eager_;
  std::mutex run_mutex_;
  std::uint64_t runs_ = 0;
  std::shared_ptr<const FaultPlan> faults_;  // null: none
  std::uint64_t runs_under_faults_ = 0;
  // The last run's state stays alive until no thread can still be leaving it.
  std::shared_ptr<detail::RunState> retired_;
};

}  // namespace weave::rt
