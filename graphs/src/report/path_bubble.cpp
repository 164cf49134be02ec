#include "weave/graphs/path_bubble.hpp"

#include <algorithm>
#include <utility>

#include "step/comm_streams.hpp"

namespace weave::graphs {

std::vector<int> pipeline_stage_of_devices(const Mesh& mesh) {
  std::vector<int> stages;
  for (int r = 0; r < mesh.size(); ++r)
    stages.push_back(mesh.coordinates(r).pp);
  return stages;
}

std::vector<rt::Nanos> bubble_of_steps(const rt::CriticalPath& path, const rt::Trace& trace,
                                       const std::vector<int>& stage_of_device) {
  std::vector<rt::Nanos> bubble(path.steps.size(), 0);
  if (path.steps.empty()) return bubble;
  const rt::TaskTable& tasks = trace.tasks();
  const auto stage = [&](rt::TaskId t) {
    const rt::DeviceId d = tasks[t].device;
    return d < stage_of_device.size() ? stage_of_device[d] : 0;
  };
  const rt::TaskId last_task = path.steps.back().task;
  const rt::DeviceId last_device = tasks[last_task].device;
  const int last = stage(last_task);
  // The last device's compute stream's spans, in time order (one stream: they do not overlap).
  std::vector<std::pair<rt::Nanos, rt::Nanos>> busy;
  for (const rt::Span& s : trace.spans())
    if (tasks[s.task].device == last_device && tasks[s.task].stream == rt::kComputeStream)
      busy.emplace_back(s.start, s.end);
  std::sort(busy.begin(), busy.end());
  for (std::size_t i = 0; i < path.steps.size(); ++i) {
    const rt::CriticalStep& s = path.steps[i];
    const rt::TaskId t = s.task;
    const bool elsewhere =
        comm_group_of(tasks.stream_kind(tasks[t].stream)) == CommGroup::pipeline ||
        stage(t) != last;
    if (!elsewhere) continue;
    rt::Nanos computing = 0;
    auto from = std::lower_bound(busy.begin(), busy.end(), std::pair{s.begin, s.begin},
                                 [](const auto& a, const auto& b) { return a.second < b.first; });
    for (auto it = from; it != busy.end() && it->first < s.end; ++it)
      computing +=
          std::max<rt::Nanos>(0, std::min(it->second, s.end) - std::max(it->first, s.begin));
    bubble[i] = (s.end - s.begin) - computing;
  }
  return bubble;
}

rt::Nanos pipeline_bubble(const rt::CriticalPath& path, const rt::Trace& trace,
                          const std::vector<int>& stage_of_device) {
  rt::Nanos time = 0;
  for (const rt::Nanos b : bubble_of_steps(path, trace, stage_of_device))
    time += b;
  return time;
}

rt::CriticalPathSummary summarize_with_bubble(const rt::CriticalPath& path, const rt::Trace& trace,
                                              const std::vector<int>& stage_of_device) {
  const std::vector<rt::Nanos> bubble = bubble_of_steps(path, trace, stage_of_device);
  // Each step shortened by its bubble, for the kinds of the rest as rt::summarize names them.
  rt::CriticalPath rest = path;
  rt::Nanos bubble_time = 0;
  for (std::size_t i = 0; i < path.steps.size(); ++i) {
    bubble_time += bubble[i];
    rest.steps[i].end -= bubble[i];
  }
  rt::CriticalPathSummary summary = rt::summarize(path, trace.tasks());
  summary.by_kind.clear();
  for (const rt::PathShare& share : rt::summarize(rest, trace.tasks()).by_kind)
    if (share.time > 0) summary.by_kind.push_back(share);
  if (bubble_time > 0) summary.by_kind.push_back({"pipeline bubble", bubble_time});
  std::stable_sort(summary.by_kind.begin(), summary.by_kind.end(),
                   [](const rt::PathShare& a, const rt::PathShare& b) { return a.time > b.time; });
  return summary;
}

}  // namespace weave::graphs
