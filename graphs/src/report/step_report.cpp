#include "weave/graphs/step_report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "step/comm_streams.hpp"
#include "weave/graphs/path_bubble.hpp"
#include "weave/runtime/critical_path.hpp"
#include "weave/runtime/graph_view.hpp"
#include "weave/runtime/trace_metrics.hpp"

namespace weave::graphs {

namespace {

// The group a stream serves, as the exposed-communication table names it.
std::string stream_group(const rt::TaskTable& tasks, rt::StreamId s) {
  if (s == rt::kComputeStream) return "compute";
  const CommGroup kind = comm_group_of(tasks.stream_kind(s));
  return std::string(kind != CommGroup::unclassified ? to_string(kind) : tasks.stream_name(s));
}

// Columns, not an object per task: a step of tens of thousands of tasks stays a few MB.
nlohmann::json task_columns(const rt::TaskTable& tasks, const rt::Trace& trace) {
  nlohmann::json name = nlohmann::json::array(), device = nlohmann::json::array(),
                 stream = nlohmann::json::array(), kind = nlohmann::json::array(),
                 layer = nlohmann::json::array(), micro_batch = nlohmann::json::array(),
                 chunk = nlohmann::json::array(), phase = nlohmann::json::array(),
                 start = nlohmann::json::array(), end = nlohmann::json::array();
  for (rt::TaskId t = 0; t < tasks.size(); ++t) {
    const rt::TaskInfo& info = tasks[t];
    name.push_back(tasks.name(t));
    device.push_back(info.device);
    stream.push_back(info.stream);
    kind.push_back(rt::to_string(info.kind));
    layer.push_back(info.tags.layer);
    micro_batch.push_back(info.tags.micro_batch);
    chunk.push_back(info.tags.chunk);
    phase.push_back(rt::to_string(info.tags.phase));
    const rt::Span* span = trace.find(t);
    start.push_back(span ? span->start : rt::Nanos{-1});
    end.push_back(span ? span->end : rt::Nanos{-1});
  }
  return {{"name", name},   {"device", device}, {"stream", stream},
          {"kind", kind},   {"layer", layer},   {"micro_batch", micro_batch},
          {"chunk", chunk}, {"phase", phase},   {"start", start},
          {"end", end}};
}

nlohmann::json graph_at(const rt::Graph& graph, rt::DetailLevel level) {
  const rt::GraphView view = rt::view_graph(graph, {.level = level});
  nlohmann::json nodes = nlohmann::json::array();
  for (const rt::ViewNode& n : view.nodes)
    nodes.push_back({{"device", n.device},
                     {"stream", n.stream},
                     {"layer", n.layer},
                     {"micro_batch", n.micro_batch},
                     {"phase", rt::to_string(n.phase)},
                     {"tasks", n.tasks}});
  nlohmann::json edges = nlohmann::json::array();
  for (const rt::ViewEdge& e : view.edges)
    edges.push_back({e.from, e.to, e.count});
  return {{"level", rt::to_string(view.level)}, {"nodes", nodes}, {"edges", edges}};
}

nlohmann::json critical_path_of(const rt::Graph& graph, const rt::Trace& trace,
                                const std::vector<int>& stages) {
  const rt::CriticalPath path = rt::critical_path(graph, trace);
  const std::vector<rt::Nanos> bubble = bubble_of_steps(path, trace, stages);
  nlohmann::json steps = nlohmann::json::array();
  for (std::size_t i = 0; i < path.steps.size(); ++i) {
    const rt::CriticalStep& s = path.steps[i];
    steps.push_back({{"task", s.task},
                     {"last_member", s.last_member},
                     {"begin", s.begin},
                     {"end", s.end},
                     {"waited_for", rt::to_string(s.waited_for)},
                     {"bubble_ns", bubble[i]}});
  }
  nlohmann::json by_kind = nlohmann::json::array();
  for (const rt::PathShare& share : summarize_with_bubble(path, trace, stages).by_kind)
    by_kind.push_back({{"what", share.what}, {"ns", share.time}});
  return {{"length_ns", path.length}, {"steps", steps}, {"by_kind", by_kind}};
}

nlohmann::json shares(const std::vector<rt::PathShare>& list) {
  nlohmann::json out = nlohmann::json::array();
  for (const rt::PathShare& share : list)
    out.push_back({{"what", share.what}, {"ns", share.time}});
  return out;
}

nlohmann::json wall_critical_path_of(const StepReportInput& input) {
  const rt::CriticalPath& path = input.wall_critical_path;
  if (path.steps.empty()) return nullptr;
  nlohmann::json steps = nlohmann::json::array();
  for (const rt::CriticalStep& s : path.steps)
    steps.push_back({{"task", s.task},
                     {"last_member", s.last_member},
                     {"begin", s.begin},
                     {"end", s.end},
                     {"waited", s.waited},
                     {"waited_for", rt::to_string(s.waited_for)}});
  const rt::CriticalPathSummary summary =
      summarize_with_bubble(path, input.wall_trace, input.stage_of_device);
  return {{"iteration", input.wall_iteration},  {"start_ns", path.start},
          {"length_ns", path.length},           {"steps", steps},
          {"by_kind", shares(summary.by_kind)}, {"by_wait", shares(summary.by_wait)}};
}

// Each process group's exposed communication: summed over the devices, and a device's share.
nlohmann::json exposed_by_group(const rt::Trace& trace) {
  const auto groups = streams_by_group(trace.tasks());
  std::vector<std::vector<rt::StreamId>> sets;
  for (const auto& group : groups)
    sets.push_back(group.second);
  const std::vector<rt::Nanos> exposed = rt::exposed_comm_on_stream_sets(trace, sets);
  const rt::TraceMetrics metrics = rt::measure(trace);
  std::size_t devices = 0;
  for (const rt::DeviceMetrics& d : metrics.devices)
    devices += d.busy > 0 ? 1 : 0;
  nlohmann::json out = nlohmann::json::array();
  for (std::size_t g = 0; g < groups.size(); ++g)
    out.push_back({{"group", groups[g].first},
                   {"ns", exposed[g]},
                   {"ms_per_device", devices > 0 ? static_cast<double>(exposed[g]) * 1e-6 /
                                                       static_cast<double>(devices)
                                                 : 0.0}});
  return out;
}

nlohmann::json memory_of(const StepReportInput& input) {
  nlohmann::json categories = nlohmann::json::array();
  for (std::size_t k = 0; k < rt::kMemoryCategoryCount; ++k)
    categories.push_back(rt::to_string(static_cast<rt::MemoryCategory>(k)));
  // Columns per device: a point per allocation or release.
  nlohmann::json over_step = nlohmann::json::array();
  for (const std::vector<MemoryPoint>& points : input.memory_over_step.devices) {
    nlohmann::json at = nlohmann::json::array(), bytes = nlohmann::json::array();
    for (const MemoryPoint& p : points) {
      at.push_back(p.at);
      bytes.push_back(p.bytes);
    }
    over_step.push_back({{"at", at}, {"bytes", bytes}});
  }
  return {{"shows", "peak"},
          {"source", input.memory_source},
          {"categories", categories},
          {"devices", input.memory},
          {"over_step", over_step}};
}

}  // namespace

void check_report_size(std::size_t tasks, std::size_t most_tasks) {
  if (tasks > most_tasks)
    throw std::invalid_argument(fmt::format(
        "--report: the step has {} tasks, more than the {} a report page holds (it would be "
        "about {} MB for the browser to draw): report a smaller step of the same shape (fewer "
        "micro-batches with --global-batch-size, fewer layers with --num-layers); for this one "
        "--critical-path, --dump-graph with --graph-level stage-micro-batch or step, and --trace "
        "work at any size",
        tasks, most_tasks, tasks * 150 / 1'000'000));
}

std::string step_report_json(const rt::Graph& graph, const rt::Trace& trace,
                             const StepReportInput& input) {
  if (trace.empty() || trace.clock() != rt::ClockKind::virtual_time)
    throw std::invalid_argument(
        "a step report reads a virtual-clock replay of the step: replay the graph with "
        "VirtualClock and record_trace");
  const rt::TaskTable& tasks = graph.tasks();
  check_report_size(tasks.size(), input.most_tasks);
  nlohmann::json j;
  j["title"] = input.title;
  j["clock"] = "virtual";
  const rt::TraceMetrics metrics = rt::measure(trace);
  j["makespan_ns"] = metrics.start + metrics.makespan;
  nlohmann::json streams = nlohmann::json::array();
  for (rt::StreamId s = 0; s < tasks.stream_count(); ++s)
    streams.push_back(
        {{"id", s}, {"name", tasks.stream_name(s)}, {"group", stream_group(tasks, s)}});
  j["streams"] = streams;
  // A lane per device and stream that holds a task, in device then stream order.
  std::vector<std::vector<bool>> used(tasks.device_count(),
                                      std::vector<bool>(tasks.stream_count(), false));
  for (rt::TaskId t = 0; t < tasks.size(); ++t)
    used[tasks[t].device][tasks[t].stream] = true;
  // The devices that hold a task: a replay that folds ranks builds only some.
  nlohmann::json lanes = nlohmann::json::array(), devices = nlohmann::json::array();
  for (rt::DeviceId d = 0; d < tasks.device_count(); ++d) {
    for (rt::StreamId s = 0; s < tasks.stream_count(); ++s)
      if (used[d][s]) lanes.push_back({{"device", d}, {"stream", s}});
    if (std::find(used[d].begin(), used[d].end(), true) != used[d].end()) devices.push_back(d);
  }
  j["devices"] = devices;
  j["lanes"] = lanes;
  j["tasks"] = task_columns(tasks, trace);
  j["graph"] = graph_at(graph, input.level);
  j["critical_path"] = critical_path_of(graph, trace, input.stage_of_device);
  j["wall_critical_path"] = wall_critical_path_of(input);
  j["exposed"] = exposed_by_group(trace);
  j["memory"] = memory_of(input);
  try {
    j["configuration"] = nlohmann::json::parse(input.configuration_json);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(
        fmt::format("a step report's configuration must be a JSON object: {}", e.what()));
  }
  return j.dump();
}

}  // namespace weave::graphs
