// One run of a graph on the executor: dependency counters, rendezvous counters, deferral
// handshakes, cancellation and the spans of the trace.
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device_queues.hpp"
#include "graph_data.hpp"
#include "timer.hpp"
#include "weave/runtime/executor.hpp"

namespace weave::rt::detail {

// Ready tasks collected while a task's successors are released, pushed to their devices'
// queues together: one lock per device instead of one per task.
class ReadyBatch {
 public:
  explicit ReadyBatch(DeviceQueues& queues) : queues_(queues) {}
  ~ReadyBatch() { flush(); }
  void add(DeviceId device, const WorkItem& item) {
    if (size_ == kCapacity) flush();
    devices_[size_] = device;
    items_[size_++] = item;
  }
  void flush();

 private:
  static constexpr std::size_t kCapacity = 32;
  DeviceQueues& queues_;
  DeviceId devices_[kCapacity];
  WorkItem items_[kCapacity];
  std::size_t size_ = 0;
};

// The fault plan a run is under, if any, and the run's index under it.
struct InjectedFaults {
  std::shared_ptr<const FaultPlan> plan;
  std::uint64_t run = 0;
};

class RunState final : public CompletionSink {
 public:
  RunState(std::shared_ptr<const GraphData> graph, std::shared_ptr<DeviceQueues> queues,
           Timer& timer, const RunOptions& options, std::uint64_t run_index,
           InjectedFaults faults = {});

  // Pushes the sources; the run then proceeds on the queues' threads.
  void start();
  bool finished() const { return finished_.load(std::memory_order_seq_cst); }
  // Called periodically by the waiting thread: cancels a run that stalled.
  void watch();
  // Called by the timer at RunOptions::deadline: cancels the run if it is still going.
  void pass_deadline();
  // Throws the TaskError of the first failure, if any.
  void rethrow_if_failed() const;
  Trace trace() const;

  void begin_deferral(TaskId task) override;
  void complete_deferred(TaskId task, std::exception_ptr error) override;

 private:
  static void run_item(void* self, std::uint32_t task);
  void execute(TaskId task);
  // The task's own work is over (its function returned or its deferral completed).
  void work_done(TaskId task, TaskId* bypass);
  void group_done(GroupId group);
  // Completes a task: releases its successors. Ready ones go to their queues, or into
  // *bypass (same device, to be run next by the calling thread) when that is free.
  void finish(TaskId task, TaskId* bypass);
  void finish_group(GroupId group);
  // Completes one task; true if it was the last sink. Tasks skipped because the run was
  // cancelled are appended to `skipped` for the caller to complete in turn.
  bool complete_one(TaskId task, TaskId* bypass, std::vector<TaskId>& skipped);
  void drain_skipped(std::vector<TaskId>& skipped, bool last);
  void release(TaskId ready, TaskId* bypass, DeviceId here, std::vector<TaskId>& skipped,
               ReadyBatch& batch);
  void arrive(TaskId member, std::vector<TaskId>& skipped);
  WorkItem item(TaskId task);
  void fail(TaskId task, std::exception_ptr error);
  // The fault plan's decision for a task of this run.
  bool injected(TaskId task, FaultKind kind) const;
  // Keeps a task the fault plan says never arrives from starting; false when the run is already
  // cancelled (the task is then skipped like any other).
  bool hold_back(TaskId task);
  // Lets the tasks held back go once the run is cancelled: they are skipped, and the collectives
  // that waited for them complete.
  void release_held_back();
  // What the run still waits for, for the watchdog's error, and the task to blame.
  std::string outstanding(TaskId& blame) const;
  bool released(TaskId task) const;
  void force_deferred();
  bool try_force(TaskId task);
  bool holds(const TaskInfo& info) const;
  void end_run();

  std::shared_ptr<const GraphData> graph_;
  const TaskTable& table_;
  std::shared_ptr<DeviceQueues> queues_;
  Timer& timer_;
  RunOptions options_;
  std::uint64_t run_index_;

  // Before a task starts: predecessors not yet completed. After: the deferral handshake bits.
  std::unique_ptr<std::atomic<std::uint32_t>[]> pending_;
  std::unique_ptr<std::atomic<std::uint32_t>[]> group_arrived_;
  std::unique_ptr<std::atomic<std::uint32_t>[]> group_finished_;
  std::vector<Nanos> group_last_arrival_;
  std::vector<Nanos> hold_until_;  // per task, with a link model
  // Per task, with a link model: the cost it reported when it ran (TaskContext::report_cost),
  // or its hint.
  std::vector<CostHint> cost_;
  std::atomic<std::uint32_t> sinks_left_;
  std::atomic<bool> finished_{false};
  std::atomic<bool> cancelled_{false};
  std::atomic<std::int64_t> deferred_outstanding_{0};
  std::atomic<std::uint64_t> deferred_completions_{0};

  mutable std::mutex error_mutex_;
  std::exception_ptr error_;
  TaskId failed_task_ = kNoTask;
  std::string failure_message_;
  std::size_t other_failures_ = 0;

  // Faults injected (empty: none), per task: 0, or 1 + FaultKind.
  std::vector<std::uint8_t> faults_;
  std::uint64_t fault_run_ = 0;
  mutable std::mutex held_back_mutex_;
  std::vector<TaskId> held_back_;

  // Stall watchdog and deadline.
  std::uint64_t last_progress_ = 0;
  Nanos stalled_since_ = -1;
  Nanos started_at_ = 0;
  // With a deadline: which tasks' work is running, for the error.
  std::unique_ptr<std::atomic<bool>[]> running_;

  // Trace spans in clock ticks; 0 = not recorded.
  std::unique_ptr<std::uint64_t[]> span_start_;
  std::unique_ptr<std::uint64_t[]> span_end_;
  std::uint64_t start_ticks_ = 0;
};

}  // namespace weave::rt::detail
