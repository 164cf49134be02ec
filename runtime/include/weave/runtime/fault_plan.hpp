// Faults injected into runs on purpose, to test what a failure does to a run: a chosen task
// throws, or a chosen task never starts (a collective member that never arrives, as when a peer
// process dies or a device hangs). A test hook: Executor::set_fault_plan for the wall clock,
// VirtualClockOptions::faults for the virtual clock.
//
//   executor.set_fault_plan({.points = {{.task = "L1.c1.dispatch[*]", .device = 0, .run = 2,
//                                        .kind = rt::FaultKind::never_arrive}},
//                            .stall_timeout = 2'000'000'000});
//
// makes rank 0's member of layer 1's second Ampipe chunk dispatch never arrive in the third
// run; the stall watchdog then cancels that run after 2 s with an error naming the collective,
// the members that arrived and the one that did not.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "weave/runtime/task_table.hpp"

namespace weave::rt {

enum class FaultKind : std::uint8_t {
  // The task throws InjectedFault instead of doing its work: the run is cancelled and fails
  // with a TaskError naming the task and its device.
  throw_error,
  // The task never starts: a rendezvous member never arrives, so its peers wait, and the tasks
  // after it never become ready. Nothing is running then, so the stall watchdog
  // (RunOptions::stall_timeout, or FaultPlan::stall_timeout) or RunOptions::deadline ends the
  // run, naming what waited.
  never_arrive,
};

// Which tasks a fault hits: every task that matches all the fields that are set.
struct FaultPoint {
  // The task's name: '*' stands for any run of characters, '?' for any one, every other
  // character for itself ('[' included: names like "L1.c0.dispatch[2]" are matched literally).
  std::string task = "*";
  std::optional<DeviceId> device;
  // The task's phase tag: forward, backward or weight (a training step's optimizer is weight).
  std::optional<Phase> phase;
  std::optional<std::int32_t> micro_batch;
  // Which run, counted from 0 for the first run after the plan was set (an Executor) or the
  // first run of the clock (a VirtualClock). Any run when empty.
  std::optional<std::uint64_t> run;
  FaultKind kind = FaultKind::throw_error;

  bool matches(const TaskTable& tasks, TaskId task, std::uint64_t run_index) const;
};

struct FaultPlan {
  std::vector<FaultPoint> points;
  // When > 0, the stall watchdog of runs under this plan fires after this long instead of
  // RunOptions::stall_timeout, so that a test of a hang need not wait the default minute.
  Nanos stall_timeout = 0;

  bool empty() const { return points.empty(); }
  // The fault for this task in this run, if a point matches (the first one that does).
  std::optional<FaultKind> fault_for(const TaskTable& tasks, TaskId task,
                                     std::uint64_t run_index) const;
};

// What a task hit by FaultKind::throw_error throws; the run's TaskError carries it as cause().
class InjectedFault : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The message of the InjectedFault a task throws.
std::string injected_fault_message(const TaskTable& tasks, TaskId task, std::uint64_t run_index);

// Whether `name` matches `pattern` ('*' any run of characters, '?' any one character).
bool matches_task_pattern(std::string_view pattern, std::string_view name);

}  // namespace weave::rt
