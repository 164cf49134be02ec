#include "weave/runtime/graph_view.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <stdexcept>
#include <tuple>

namespace weave::rt {

namespace {

template <typename T>
bool allows(const std::vector<T>& values, const T& v) {
  return values.empty() || std::find(values.begin(), values.end(), v) != values.end();
}

std::int32_t parse_int(std::string_view key, std::string_view value) {
  std::int32_t v = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size() || v < 0)
    throw std::invalid_argument(
        fmt::format("graph filter: {}={} is not a whole number from 0: write {}=<n>, e.g. {}=0",
                    key, value, key, key));
  return v;
}

Phase parse_phase(std::string_view value) {
  if (value == "F") return Phase::forward;
  if (value == "B") return Phase::backward;
  if (value == "W") return Phase::weight;
  throw std::invalid_argument(fmt::format(
      "graph filter: phase={} is not a phase: write phase=F (forward), phase=B (backward, input "
      "gradient) or phase=W (weight gradient)",
      value));
}

// The tags a level merges by: the rest read as -1 / Phase::none.
using NodeKey = std::tuple<DeviceId, StreamId, std::int32_t, std::int32_t, Phase, TaskId>;

NodeKey key_of(const TaskTable& tasks, TaskId t, DetailLevel level) {
  const TaskInfo& info = tasks[t];
  switch (level) {
    case DetailLevel::task:
      return {info.device, info.stream, info.tags.layer, info.tags.micro_batch, info.tags.phase, t};
    case DetailLevel::layer:
      return {info.device, info.stream, info.tags.layer, -1, info.tags.phase, 0};
    case DetailLevel::stage_micro_batch:
      return {info.device, info.stream, -1, info.tags.micro_batch, info.tags.phase, 0};
    case DetailLevel::step:
      return {info.device, info.stream, -1, -1, Phase::none, 0};
  }
  return {};
}

void assign_nodes(const Graph& graph, const GraphViewOptions& options, GraphView& view) {
  const TaskTable& tasks = graph.tasks();
  view.node_of.assign(tasks.size(), kNoViewNode);
  // Ordered by device and stream, then by where the node's first task sits.
  std::map<NodeKey, std::uint32_t> first_task_of;
  for (TaskId t = 0; t < tasks.size(); ++t) {
    if (!options.filter.selects(tasks, t)) continue;
    first_task_of.try_emplace(key_of(tasks, t, options.level), t);
  }
  std::vector<std::pair<NodeKey, TaskId>> keys(first_task_of.begin(), first_task_of.end());
  std::sort(keys.begin(), keys.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a.first), std::get<1>(a.first), a.second) <
           std::tie(std::get<0>(b.first), std::get<1>(b.first), b.second);
  });
  std::map<NodeKey, std::uint32_t> index;
  for (const auto& [key, first] : keys) {
    index.emplace(key, static_cast<std::uint32_t>(view.nodes.size()));
    ViewNode node;
    node.device = std::get<0>(key);
    node.stream = std::get<1>(key);
    node.layer = std::get<2>(key);
    node.micro_batch = std::get<3>(key);
    node.phase = std::get<4>(key);
    view.nodes.push_back(std::move(node));
  }
  for (TaskId t = 0; t < tasks.size(); ++t) {
    if (!options.filter.selects(tasks, t)) continue;
    const std::uint32_t n = index.at(key_of(tasks, t, options.level));
    view.node_of[t] = n;
    view.nodes[n].tasks.push_back(t);
  }
}

// Paths from a node's tasks through left-out tasks only, to the first shown task on each.
void add_hidden_paths(const Graph& graph, GraphView& view,
                      std::map<std::pair<std::uint32_t, std::uint32_t>, ViewEdge>& edges) {
  std::vector<std::uint32_t> seen(view.node_of.size(), kNoViewNode);
  std::vector<TaskId> frontier;
  for (std::uint32_t n = 0; n < view.nodes.size(); ++n) {
    for (TaskId t : view.nodes[n].tasks)
      for (TaskId s : graph.successors(t))
        if (view.node_of[s] == kNoViewNode && seen[s] != n) {
          seen[s] = n;
          frontier.push_back(s);
        }
    while (!frontier.empty()) {
      const TaskId h = frontier.back();
      frontier.pop_back();
      for (TaskId s : graph.successors(h)) {
        if (seen[s] == n) continue;
        seen[s] = n;
        const std::uint32_t m = view.node_of[s];
        if (m == kNoViewNode) {
          frontier.push_back(s);
        } else if (m != n) {
          auto [it, added] = edges.try_emplace({n, m});
          if (added) it->second = {.from = n, .to = m, .hidden = true};
        }
      }
    }
  }
}

}  // namespace

DetailLevel parse_detail_level(std::string_view word) {
  for (DetailLevel l :
       {DetailLevel::task, DetailLevel::layer, DetailLevel::stage_micro_batch, DetailLevel::step})
    if (word == to_string(l)) return l;
  throw std::invalid_argument(fmt::format(
      "graph level '{}' is not a level of detail: choose task (a node per task), layer (per "
      "device, stream, layer and phase), stage-micro-batch (per device, stream, micro-batch and "
      "phase) or step (per device and stream)",
      word));
}

std::string_view to_string(DetailLevel level) {
  switch (level) {
    case DetailLevel::task:
      return "task";
    case DetailLevel::layer:
      return "layer";
    case DetailLevel::stage_micro_batch:
      return "stage-micro-batch";
    case DetailLevel::step:
      return "step";
  }
  return "?";
}

bool GraphFilter::empty() const {
  return devices.empty() && streams.empty() && layers.empty() && micro_batches.empty() &&
         chunks.empty() && phases.empty();
}

bool GraphFilter::selects(const TaskTable& tasks, TaskId task) const {
  const TaskInfo& info = tasks[task];
  if (!allows(devices, info.device) || !allows(layers, info.tags.layer) ||
      !allows(micro_batches, info.tags.micro_batch) || !allows(chunks, info.tags.chunk) ||
      !allows(phases, info.tags.phase))
    return false;
  if (streams.empty()) return true;
  const std::string_view name = tasks.stream_name(info.stream);
  return std::find(streams.begin(), streams.end(), name) != streams.end();
}

GraphFilter parse_graph_filter(std::string_view spec) {
  GraphFilter f;
  while (!spec.empty()) {
    const std::size_t comma = spec.find(',');
    const std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    const std::size_t eq = item.find('=');
    const std::string_view key = item.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? "" : item.substr(eq + 1);
    if (value.empty())
      throw std::invalid_argument(fmt::format(
          "graph filter: '{}' has no value: write key=value, e.g. device=0 or phase=F", item));
    if (key == "device")
      f.devices.push_back(static_cast<DeviceId>(parse_int(key, value)));
    else if (key == "stream")
      f.streams.emplace_back(value);
    else if (key == "layer")
      f.layers.push_back(parse_int(key, value));
    else if (key == "micro-batch")
      f.micro_batches.push_back(parse_int(key, value));
    else if (key == "chunk")
      f.chunks.push_back(parse_int(key, value));
    else if (key == "phase")
      f.phases.push_back(parse_phase(value));
    else
      throw std::invalid_argument(fmt::format(
          "graph filter: '{}' is not a key: filter by device, stream, layer, micro-batch, chunk "
          "or phase (e.g. device=0,layer=3,phase=F)",
          key));
  }
  return f;
}

GraphView view_graph(const Graph& graph, const GraphViewOptions& options) {
  GraphView view;
  view.level = options.level;
  assign_nodes(graph, options, view);
  std::map<std::pair<std::uint32_t, std::uint32_t>, ViewEdge> edges;
  for (TaskId t = 0; t < graph.size(); ++t) {
    const std::uint32_t n = view.node_of[t];
    if (n == kNoViewNode) continue;
    const auto succ = graph.successors(t);
    const auto kinds = graph.successor_kinds(t);
    for (std::size_t i = 0; i < succ.size(); ++i) {
      const std::uint32_t m = view.node_of[succ[i]];
      if (m == kNoViewNode || m == n) continue;
      auto [it, added] = edges.try_emplace({n, m});
      ViewEdge& e = it->second;
      if (added) e = {.from = n, .to = m, .all_stream_order = true, .all_event = true};
      ++e.count;
      e.all_stream_order = e.all_stream_order && kinds[i] == EdgeKind::stream_order;
      e.all_event = e.all_event && kinds[i] == EdgeKind::event;
    }
  }
  if (!options.filter.empty()) add_hidden_paths(graph, view, edges);
  view.edges.reserve(edges.size());
  for (const auto& [key, e] : edges)
    view.edges.push_back(e);
  return view;
}

}  // namespace weave::rt
