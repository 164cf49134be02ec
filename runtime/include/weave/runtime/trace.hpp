// What a run did: one span per task that ran, on the wall clock or the virtual clock.
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "weave/runtime/task_table.hpp"

namespace weave::rt {

// A task's interval. A rendezvous member's span starts when it arrived (it holds its stream
// while it waits for the others, as a collective kernel does) and ends when the group completed.
struct Span {
  TaskId task = kNoTask;
  Nanos start = 0;
  Nanos end = 0;
};

enum class ClockKind : std::uint8_t { wall, virtual_time };

class Trace {
 public:
  Trace() = default;
  Trace(std::shared_ptr<const TaskTable> tasks, std::vector<Span> spans, ClockKind clock);

  bool empty() const { return spans_.empty(); }
  const TaskTable& tasks() const { return *tasks_; }
  std::span<const Span> spans() const { return spans_; }
  ClockKind clock() const { return clock_; }
  // The span of a task, or null if it did not run (the run was cancelled first).
  const Span* find(TaskId task) const;
  // The first span whose task has this name, or null.
  const Span* find(std::string_view name) const;
  // The spans of tasks on these devices only (the same task table and clock): a replay of
  // thousands of devices drawn for the few a person looks at.
  Trace only_devices(std::span<const DeviceId> devices) const;

 private:
  std::shared_ptr<const TaskTable> tasks_;
  std::vector<Span> spans_;  // sorted by task id
  ClockKind clock_ = ClockKind::wall;
};

}  // namespace weave::rt
