#include "weave/runtime/critical_path.hpp"

#include "trace_times.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <stdexcept>

namespace weave::rt {

namespace {

// The replay's times per task, the graph's predecessors and, per device, compute tasks by end.
class PathWalk {
 public:
  PathWalk(const Graph& graph, const Trace& trace) : tasks_(graph.tasks()) {
    if (trace.clock() != ClockKind::virtual_time || trace.tasks().size() != tasks_.size())
      throw std::invalid_argument(fmt::format(
          "critical path: the trace has {} tasks on the {} clock and the graph {} tasks: give the "
          "virtual-clock trace of this graph's replay (VirtualClock with record_trace)",
          trace.tasks().size(), trace.clock() == ClockKind::virtual_time ? "virtual" : "wall",
          tasks_.size()));
    times_ = read_trace_times(graph, trace);
    for (TaskId t = 0; t < tasks_.size(); ++t) {
      if (!times_.ran(t))
        throw std::invalid_argument(fmt::format(
            "critical path: task '{}' has no span in the trace: give the trace of a replay that "
            "ran every task",
            tasks_.name(t)));
      if (tasks_[t].kind == TaskKind::compute && tasks_[t].group == kNoGroup)
        compute_by_end_[tasks_[t].device].emplace_back(times_.end[t], t);
    }
    for (auto& [device, ends] : compute_by_end_)
      std::sort(ends.begin(), ends.end());
  }

  CriticalPath walk() {
    CriticalPath path;
    TaskId current = kNoTask;
    for (TaskId t = 0; t < tasks_.size(); ++t)
      if (current == kNoTask || times_.end[t] > times_.end[current]) current = t;
    if (current == kNoTask) return path;
    path.length = times_.end[current];
    on_path_.assign(tasks_.size(), false);
    while (current != kNoTask) {
      if (on_path_[current])
        throw std::logic_error(fmt::format(
            "critical path: task '{}' reached twice: the trace does not follow the graph's "
            "rules (a replay of another graph?)",
            tasks_.name(current)));
      on_path_[current] = true;
      current = step_back(current, path.steps);
    }
    std::reverse(path.steps.begin(), path.steps.end());
    return path;
  }

 private:
  // Adds the step for `t` and returns the task it waited for (kNoTask at the step's start). The
  // step's `waited_for` is set by the walk when it adds the step after it in time.
  TaskId step_back(TaskId t, std::vector<CriticalStep>& steps) {
    CriticalStep step{.task = t, .last_member = t, .begin = times_.start[t], .end = times_.end[t]};
    TaskId from = t;  // whose readiness started the step
    if (const GroupId g = tasks_[t].group; g != kNoGroup) {
      for (TaskId m : tasks_.members(g))
        if (times_.start[m] > times_.start[from]) from = m;
      step.last_member = from;
      step.begin = times_.start[from];
    }
    if (!steps.empty() && steps.back().waited_for == CriticalLink::start)
      steps.back().waited_for = pending_link_;
    steps.push_back(step);
    if (step.begin == 0 && times_.predecessors[from].empty()) return kNoTask;
    // A predecessor that ended as the step began, a data dependency before stream order.
    const TracedPredecessor* best = nullptr;
    for (const TracedPredecessor& p : times_.predecessors[from])
      if (times_.end[p.task] == step.begin &&
          (!best || (best->kind == EdgeKind::stream_order && p.kind != EdgeKind::stream_order)))
        best = &p;
    if (best) {
      pending_link_ =
          tasks_[t].group != kNoGroup && from != t ? CriticalLink::collective : link_of(best->kind);
      return best->task;
    }
    pending_link_ = CriticalLink::engine;
    return engine_holder(t, step.begin);
  }

  // The compute task that freed `t`'s device engine at `time`: the one that started last before
  // `t` (a task that takes no time may have started at `time` too, just before `t`).
  TaskId engine_holder(TaskId t, Nanos time) const {
    const auto found = compute_by_end_.find(tasks_[t].device);
    TaskId holder = kNoTask;
    if (found != compute_by_end_.end()) {
      const auto& ends = found->second;
      for (auto it = std::lower_bound(ends.begin(), ends.end(), std::pair{time, TaskId{0}});
           it != ends.end() && it->first == time; ++it) {
        const TaskId h = it->second;
        if (h != t && !on_path_[h] && times_.start[h] <= times_.start[t] &&
            (holder == kNoTask || times_.start[h] > times_.start[holder]))
          holder = h;
      }
    }
    if (holder == kNoTask)
      throw std::logic_error(fmt::format(
          "critical path: task '{}' started at {} ns with nothing ending then that it waited for: "
          "the trace does not follow the graph's rules (a replay of another graph?)",
          tasks_.name(t), time));
    return holder;
  }

  const TaskTable& tasks_;
  TraceTimes times_;
  std::map<DeviceId, std::vector<std::pair<Nanos, TaskId>>> compute_by_end_;
  std::vector<bool> on_path_;
  CriticalLink pending_link_ = CriticalLink::start;
};

std::vector<PathShare> largest_first(const std::map<std::string, Nanos>& shares) {
  std::vector<PathShare> out;
  for (const auto& [what, time] : shares)
    out.push_back({what, time});
  std::stable_sort(out.begin(), out.end(),
                   [](const PathShare& a, const PathShare& b) { return a.time > b.time; });
  return out;
}

}  // namespace

std::string_view to_string(CriticalLink link) {
  switch (link) {
    case CriticalLink::start:
      return "start";
    case CriticalLink::dependency:
      return "data dependency";
    case CriticalLink::stream_order:
      return "stream order";
    case CriticalLink::event:
      return "event";
    case CriticalLink::collective:
      return "last member of a collective";
    case CriticalLink::engine:
      return "compute engine";
    case CriticalLink::device:
      return "previous task on its device";
  }
  return "?";
}

std::vector<TaskId> CriticalPath::tasks() const {
  std::vector<TaskId> out;
  for (const CriticalStep& s : steps) {
    if (s.last_member != s.task) out.push_back(s.last_member);
    out.push_back(s.task);
  }
  return out;
}

CriticalPath critical_path(const Graph& graph, const Trace& trace) {
  return PathWalk(graph, trace).walk();
}

CriticalPathSummary summarize(const CriticalPath& path, const TaskTable& tasks) {
  std::map<std::string, Nanos> by_kind, by_wait;
  for (std::size_t i = 0; i < path.steps.size(); ++i) {
    const CriticalStep& s = path.steps[i];
    const TaskInfo& info = tasks[s.task];
    std::string kind = info.kind == TaskKind::compute ? "compute"
                       : info.kind == TaskKind::host
                           ? "host"
                           : fmt::format("{} communication", tasks.stream_name(info.stream));
    by_kind[kind] += s.end - s.begin;
    // A step is on the path because the next one waited for it.
    const CriticalLink why =
        i + 1 < path.steps.size() ? path.steps[i + 1].waited_for : CriticalLink::start;
    by_wait[i + 1 < path.steps.size() ? std::string(to_string(why)) : "last task"] +=
        s.end - s.begin;
    if (s.waited > 0) {
      by_kind[std::string(kWallWait)] += s.waited;
      by_wait[std::string(kWallWait)] += s.waited;
    }
  }
  return {largest_first(by_kind), largest_first(by_wait)};
}

}  // namespace weave::rt
