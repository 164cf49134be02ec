#include "weave/runtime/trace.hpp"

#include <algorithm>

namespace weave::rt {

Trace::Trace(std::shared_ptr<const TaskTable> tasks, std::vector<Span> spans, ClockKind clock)
    : tasks_(std::move(tasks)), spans_(std::move(spans)), clock_(clock) {
  std::sort(spans_.begin(), spans_.end(),
            [](const Span& a, const Span& b) { return a.task < b.task; });
}

Trace Trace::only_devices(std::span<const DeviceId> devices) const {
  std::vector<bool> kept;
  for (DeviceId d : devices) {
    if (d >= kept.size()) kept.resize(static_cast<std::size_t>(d) + 1, false);
    kept[d] = true;
  }
  std::vector<Span> spans;
  for (const Span& s : spans_) {
    const DeviceId d = (*tasks_)[s.task].device;
    if (d < kept.size() && kept[d]) spans.push_back(s);
  }
  return Trace(tasks_, std::move(spans), clock_);
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
