// The critical path of a run on the wall clock, from its recorded spans (critical_path.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "weave/runtime/critical_path.hpp"

#include "trace_times.hpp"

namespace weave::rt {

namespace {

class WallWalk {
 public:
  WallWalk(const Graph& graph, const Trace& trace) : tasks_(graph.tasks()) {
    if (trace.clock() != ClockKind::wall || trace.tasks().size() != tasks_.size())
      throw std::invalid_argument(fmt::format(
          "wall-clock critical path: the trace has {} tasks on the {} clock and the graph {} "
          "tasks: give the wall-clock trace of a run of this graph (RunOptions::record_trace)",
          trace.tasks().size(), trace.clock() == ClockKind::virtual_time ? "virtual" : "wall",
          tasks_.size()));
    times_ = read_trace_times(graph, trace);
    for (TaskId t = 0; t < tasks_.size(); ++t)
      if (ran(t)) by_end_[tasks_[t].device].emplace_back(times_.end[t], t);
    for (auto& [device, ends] : by_end_)
      std::sort(ends.begin(), ends.end());
  }

  CriticalPath walk() {
    CriticalPath path;
    path.clock = ClockKind::wall;
    TaskId current = kNoTask;
    for (TaskId t = 0; t < tasks_.size(); ++t)
      if (ran(t) && (current == kNoTask || times_.end[t] > times_.end[current])) current = t;
    if (current == kNoTask) return path;
    Nanos first = times_.end[current];
    for (TaskId t = 0; t < tasks_.size(); ++t)
      if (ran(t)) first = std::min(first, times_.start[t]);
    path.start = first;
    path.length = times_.end[current] - first;
    on_path_.assign(tasks_.size(), false);
    Nanos next_begin = times_.end[current];  // where the step after the one added next begins
    while (current != kNoTask) {
      on_path_[current] = true;
      CriticalStep step{.task = current, .last_member = current, .begin = times_.start[current]};
      // Ends where the step after it begins: a clock read on another core may put a task's end a
      // tick past its successor's start.
      step.end = std::min(times_.end[current], next_begin);
      TaskId from = current;  // whose readiness started the step
      if (const GroupId g = tasks_[current].group; g != kNoGroup) {
        for (TaskId m : tasks_.members(g))
          if (ran(m) && times_.start[m] > times_.start[from]) from = m;
        step.last_member = from;
        step.begin = std::min(times_.start[from], step.end);
      }
      const auto [before, how] = latest_before(from, step.begin);
      const Nanos ended = before == kNoTask ? first : std::min(times_.end[before], step.begin);
      step.waited = step.begin - ended;
      step.waited_for = how;
      path.steps.push_back(step);
      next_begin = ended;
      current = before;
    }
    std::reverse(path.steps.begin(), path.steps.end());
    return path;
  }

 private:
  bool ran(TaskId t) const { return times_.ran(t); }

  // What `t`, ready at `begin`, waited for: of its graph predecessors that ran and the task that
  // ran before it on its device (ended by `begin`, started no later than `t`), the one that ended
  // last, a graph edge before the device on a tie, a data dependency before stream order.
  std::pair<TaskId, CriticalLink> latest_before(TaskId t, Nanos begin) const {
    TaskId best = kNoTask;
    CriticalLink how = CriticalLink::start;
    auto rank = [](CriticalLink l) {
      return l == CriticalLink::dependency     ? 0
             : l == CriticalLink::event        ? 1
             : l == CriticalLink::stream_order ? 2
                                               : 3;
    };
    auto consider = [&](TaskId p, CriticalLink l) {
      if (on_path_[p] || !ran(p)) return;
      if (best == kNoTask || times_.end[p] > times_.end[best] ||
          (times_.end[p] == times_.end[best] && rank(l) < rank(how))) {
        best = p;
        how = l;
      }
    };
    for (const TracedPredecessor& p : times_.predecessors[t])
      consider(p.task, link_of(p.kind));
    const auto found = by_end_.find(tasks_[t].device);
    if (found != by_end_.end()) {
      const auto& ends = found->second;
      // The latest end at or before `begin` on the device, of a task that started no later.
      auto it = std::upper_bound(ends.begin(), ends.end(), std::pair{begin, kNoTask});
      while (it != ends.begin()) {
        --it;
        const TaskId h = it->second;
        if (best != kNoTask && it->first < times_.end[best]) break;
        if (h != t && !on_path_[h] && times_.start[h] <= times_.start[t] &&
            times_.start[h] <= begin) {
          consider(h, CriticalLink::device);
          break;
        }
      }
    }
    return {best, how};
  }

  const TaskTable& tasks_;
  TraceTimes times_;
  std::map<DeviceId, std::vector<std::pair<Nanos, TaskId>>> by_end_;
  std::vector<bool> on_path_;
};

}  // namespace

CriticalPath wall_critical_path(const Graph& graph, const Trace& trace) {
  return WallWalk(graph, trace).walk();
}

}  // namespace weave::rt
