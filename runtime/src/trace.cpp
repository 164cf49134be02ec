#include "weave/runtime/trace.hpp"

#include <algorithm>

namespace weave::rt {

Trace::Trace(std::shared_ptr<const TaskTable> tasks, std::vector<Span> spans, ClockKind clock)
    : tasks_(std::move(tasks)), spans_(std::move(spans)), clock_(clock) {
  std::sort(spans_.begin(), spans_.end(),
            [](const Span& a, const Span& b) { return a.task < b.task; });
}

const Span* Trace::find(TaskId task) const {
  auto it = std::lower_bound(spans_.begin(), spans_.end(), task,
                             [](const Span& s, TaskId t) { return s.task < t; });
  return it != spans_.end() && it->task == task ? &*it : nullptr;
}

const Span* Trace::find(std::string_view name) const {
  for (const Span& s : spans_) {
    if (tasks_->name(s.task) == name) return &s;
  }
  return nullptr;
}

}  // namespace weave::rt
