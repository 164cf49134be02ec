// What a task's function sees while it runs.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "weave/runtime/completion.hpp"
#include "weave/runtime/task_table.hpp"

namespace weave::rt {

class TaskContext;
using TaskFn = std::function<void(TaskContext&)>;

class TaskContext {
 public:
  // Built by the executor and the virtual clock only.
  TaskContext(const TaskTable& table, TaskId task, std::uint64_t run_index, bool virtual_time,
              detail::CompletionSink* sink)
      : table_(table), task_(task), run_index_(run_index), virtual_(virtual_time), sink_(sink) {}

  TaskId id() const { return task_; }
  std::string_view name() const { return table_.name(task_); }
  const TaskInfo& info() const { return table_[task_]; }
  DeviceId device() const { return table_[task_].device; }
  // Counts the runs of the executor (or virtual clock) this task belongs to, from 0. State kept
  // across runs (a rendezvous buffer, say) can key on it.
  std::uint64_t run_index() const { return run_index_; }
  // True when the virtual clock replays the graph rather than the executor running it.
  bool virtual_time() const { return virtual_; }

  // The task completes when the returned handle is completed, not when the function returns.
  // Call at most once.
  Completion defer();
  bool deferred() const { return deferred_; }

  // The task's cost as it turned out (a variable all-to-all's real split, known only now): the
  // virtual clock and the executor's link model time the task by it instead of its hint.
  void report_cost(const CostHint& cost) { reported_cost_ = cost; }
  const std::optional<CostHint>& reported_cost() const { return reported_cost_; }

 private:
  const TaskTable& table_;
  TaskId task_;
  std::uint64_t run_index_;
  bool virtual_;
  bool deferred_ = false;
  std::optional<CostHint> reported_cost_;
  detail::CompletionSink* sink_;
};

}  // namespace weave::rt
