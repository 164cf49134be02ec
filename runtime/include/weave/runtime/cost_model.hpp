// How long a task takes in modelled time. The virtual clock uses it for every task; the
// executor uses it to hold comm and copy tasks' completion as a slow link would.
#pragma once

#include "weave/runtime/task_table.hpp"
#include "weave/runtime/types.hpp"

namespace weave::rt {

class CostModel {
 public:
  virtual ~CostModel() = default;
  // Modelled duration of one run of the task at `cost` (its hint, or what the task reported
  // when it ran: see TaskContext::report_cost). For a rendezvous member this is the member's
  // share; the group lasts as long as its slowest member.
  virtual Nanos duration(const TaskTable& tasks, TaskId task, const CostHint& cost) const = 0;
  // At the task's build-time hint.
  Nanos duration(const TaskTable& tasks, TaskId task) const {
    return duration(tasks, task, tasks[task].cost);
  }
};

// One compute rate for every device and one link between any two: compute tasks last
// flops / flops_per_second, comm and copy tasks messages * latency + bytes / bytes_per_second
// (at least one message when bytes > 0), host tasks nothing. Durations round to whole ns.
class UniformCostModel : public CostModel {
 public:
  UniformCostModel(double flops_per_second, Nanos latency, double bytes_per_second);
  using CostModel::duration;
  Nanos duration(const TaskTable& tasks, TaskId task, const CostHint& cost) const override;

 private:
  double flops_per_second_;
  Nanos latency_;
  double bytes_per_second_;
};

}  // namespace weave::rt
