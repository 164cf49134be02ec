#include "weave/runtime/dot_writer.hpp"

#include <fmt/format.h>

#include <map>
#include <ostream>
#include <vector>

#include "escape.hpp"

namespace weave::rt {

namespace {
const char* fill_colour(TaskKind kind) {
  switch (kind) {
    case TaskKind::compute:
      return "#9ecae1";  // blue
    case TaskKind::comm:
      return "#fdae6b";  // orange
    case TaskKind::copy:
      return "#c7e9c0";  // green
    case TaskKind::host:
      return "#d9d9d9";  // grey
  }
  return "white";
}
}  // namespace

void write_dot(const Graph& graph, std::ostream& out) {
  const TaskTable& tasks = graph.tasks();
  std::string buf;
  buf += "digraph weave {\n  rankdir=LR;\n  compound=true;\n";
  buf += "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10];\n";
  buf += "  edge [fontname=\"Helvetica\", fontsize=8];\n";

  // One cluster per device, one sub-cluster per stream, tasks in stream order.
  std::map<DeviceId, std::map<StreamId, std::vector<TaskId>>> placement;
  for (TaskId t = 0; t < tasks.size(); ++t)
    placement[tasks[t].device][tasks[t].stream].push_back(t);
  for (const auto& [device, streams] : placement) {
    fmt::format_to(std::back_inserter(buf),
                   "  subgraph cluster_d{} {{\n    label=\"device {}\";\n    style=rounded;\n",
                   device, device);
    for (const auto& [stream, ids] : streams) {
      fmt::format_to(std::back_inserter(buf), "    subgraph cluster_d{}_s{} {{\n      label=\"",
                     device, stream);
      detail::append_dot_escaped(buf, tasks.stream_name(stream));
      buf += "\";\n      style=dashed;\n";
      for (TaskId t : ids) {
        const TaskInfo& info = tasks[t];
        fmt::format_to(std::back_inserter(buf), "      t{} [label=\"", t);
        detail::append_dot_escaped(buf, tasks.name(t));
        fmt::format_to(std::back_inserter(buf), "\\n{}\", fillcolor=\"{}\"", to_string(info.kind),
                       fill_colour(info.kind));
        if (info.group != kNoGroup) buf += ", peripheries=2";
        buf += "];\n";
      }
      buf += "    }\n";
    }
    buf += "  }\n";
  }

  for (TaskId t = 0; t < tasks.size(); ++t) {
    const auto succ = graph.successors(t);
    const auto kinds = graph.successor_kinds(t);
    for (std::size_t i = 0; i < succ.size(); ++i) {
      fmt::format_to(std::back_inserter(buf), "  t{} -> t{}", t, succ[i]);
      switch (kinds[i]) {
        case EdgeKind::stream_order:
          buf += " [style=dashed, color=\"#888888\"]";
          break;
        case EdgeKind::event:
          buf += " [style=dotted, color=\"#3182bd\", label=\"event\"]";
          break;
        case EdgeKind::explicit_dependency:
          break;
      }
      buf += ";\n";
    }
  }
  // Rendezvous members joined by an undirected bold line that does not affect layout.
  for (GroupId g = 0; g < tasks.group_count(); ++g) {
    const auto members = tasks.members(g);
    for (std::size_t i = 1; i < members.size(); ++i) {
      fmt::format_to(std::back_inserter(buf),
                     "  t{} -> t{} [dir=none, style=bold, color=\"#756bb1\", constraint=false",
                     members[i - 1], members[i]);
      if (i == 1) {
        buf += ", label=\"";
        detail::append_dot_escaped(buf, tasks.group_name(g));
        buf += '"';
      }
      buf += "];\n";
    }
  }
  buf += "}\n";
  out.write(buf.data(), static_cast<std::streamsize>(buf.size()));
}

}  // namespace weave::rt
