#include "weave/runtime/dot_writer.hpp"

#include <fmt/format.h>

#include <array>
#include <ostream>
#include <set>
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

constexpr const char* kCritical = "#d62728";

using NodePair = std::pair<std::uint32_t, std::uint32_t>;

class DotWriter {
 public:
  DotWriter(const Graph& graph, const DotOptions& options)
      : tasks_(graph.tasks()),
        view_(view_graph(graph, options.view)),
        per_task_(view_.level == DetailLevel::task) {
    mark_critical(options.critical_path);
  }

  std::string write() {
    // newrank: ranks across clusters in one pass (without it GraphViz fails with "trouble in
    // init_rank" on clusters joined by many edges).
    buf_ += "digraph weave {\n  rankdir=LR;\n  compound=true;\n  newrank=true;\n";
    buf_ += "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10];\n";
    buf_ += "  edge [fontname=\"Helvetica\", fontsize=8];\n";
    write_clusters();
    write_edges();
    write_rendezvous();
    buf_ += "}\n";
    return std::move(buf_);
  }

 private:
  // Consecutive tasks of the path that sit in different nodes make a critical link.
  void mark_critical(const std::vector<TaskId>& path) {
    critical_nodes_.assign(view_.nodes.size(), false);
    std::uint32_t previous = kNoViewNode;
    for (TaskId t : path) {
      const std::uint32_t n = t < view_.node_of.size() ? view_.node_of[t] : kNoViewNode;
      if (n == kNoViewNode) {
        previous = kNoViewNode;
        continue;
      }
      critical_nodes_[n] = true;
      if (previous != kNoViewNode && previous != n) critical_links_.insert({previous, n});
      previous = n;
    }
  }

  std::string node_id(std::uint32_t n) const {
    return per_task_ ? fmt::format("t{}", view_.nodes[n].tasks.front()) : fmt::format("n{}", n);
  }

  // A merged node is drawn in the colour of the kind most of its tasks have.
  TaskKind main_kind(const ViewNode& node) const {
    std::array<std::size_t, 4> count{};
    for (TaskId t : node.tasks)
      ++count[static_cast<std::size_t>(tasks_[t].kind)];
    std::size_t best = 0;
    for (std::size_t k = 1; k < count.size(); ++k)
      if (count[k] > count[best]) best = k;
    return static_cast<TaskKind>(best);
  }

  void write_label(const ViewNode& node) {
    if (per_task_) {
      const TaskId t = node.tasks.front();
      detail::append_dot_escaped(buf_, tasks_.name(t));
      fmt::format_to(std::back_inserter(buf_), "\\n{}", to_string(tasks_[t].kind));
      return;
    }
    std::string what;
    if (view_.level == DetailLevel::layer)
      what = node.layer < 0 ? "no layer" : fmt::format("layer {}", node.layer);
    else if (view_.level == DetailLevel::stage_micro_batch)
      what =
          node.micro_batch < 0 ? "no micro-batch" : fmt::format("micro-batch {}", node.micro_batch);
    else
      what = "step";
    if (node.phase != Phase::none) what += fmt::format(" {}", to_string(node.phase));
    fmt::format_to(std::back_inserter(buf_), "{}\\n{} task{}", what, node.tasks.size(),
                   node.tasks.size() == 1 ? "" : "s");
  }

  void write_node(std::uint32_t n) {
    const ViewNode& node = view_.nodes[n];
    fmt::format_to(std::back_inserter(buf_), "      {} [label=\"", node_id(n));
    write_label(node);
    fmt::format_to(std::back_inserter(buf_), "\", fillcolor=\"{}\"", fill_colour(main_kind(node)));
    if (per_task_ && tasks_[node.tasks.front()].group != kNoGroup) buf_ += ", peripheries=2";
    if (critical_nodes_[n])
      fmt::format_to(std::back_inserter(buf_), ", color=\"{}\", penwidth=3", kCritical);
    buf_ += "];\n";
  }

  // One cluster per device, one sub-cluster per stream; nodes come ordered by both.
  void write_clusters() {
    std::size_t i = 0;
    while (i < view_.nodes.size()) {
      const DeviceId device = view_.nodes[i].device;
      fmt::format_to(std::back_inserter(buf_),
                     "  subgraph cluster_d{} {{\n    label=\"device {}\";\n    style=rounded;\n",
                     device, device);
      while (i < view_.nodes.size() && view_.nodes[i].device == device) {
        const StreamId stream = view_.nodes[i].stream;
        fmt::format_to(std::back_inserter(buf_), "    subgraph cluster_d{}_s{} {{\n      label=\"",
                       device, stream);
        detail::append_dot_escaped(buf_, tasks_.stream_name(stream));
        buf_ += "\";\n      style=dashed;\n";
        for (; i < view_.nodes.size() && view_.nodes[i].device == device &&
               view_.nodes[i].stream == stream;
             ++i)
          write_node(static_cast<std::uint32_t>(i));
        buf_ += "    }\n";
      }
      buf_ += "  }\n";
    }
  }

  void write_edge_style(const ViewEdge& e, bool critical) {
    std::vector<std::string> attrs;
    if (e.hidden)
      attrs.emplace_back("style=dashed, color=\"#9e9ac8\", label=\"via hidden tasks\"");
    else if (e.all_stream_order)
      attrs.emplace_back("style=dashed, color=\"#888888\"");
    else if (e.all_event)
      attrs.emplace_back("style=dotted, color=\"#3182bd\", label=\"event\"");
    if (!per_task_ && e.count > 1 && !e.all_event)
      attrs.push_back(fmt::format("label=\"{}\"", e.count));
    if (critical) attrs.push_back(fmt::format("color=\"{}\", penwidth=3", kCritical));
    if (attrs.empty()) return;
    buf_ += " [";
    for (std::size_t i = 0; i < attrs.size(); ++i)
      buf_ += (i ? ", " : "") + attrs[i];
    buf_ += "]";
  }

  void write_edges() {
    std::set<NodePair> drawn;
    for (const ViewEdge& e : view_.edges) {
      const bool critical = critical_links_.count({e.from, e.to}) > 0;
      if (critical) drawn.insert({e.from, e.to});
      fmt::format_to(std::back_inserter(buf_), "  {} -> {}", node_id(e.from), node_id(e.to));
      write_edge_style(e, critical);
      buf_ += ";\n";
    }
    // A link of the path that is no edge: the later task waited for a shared compute engine.
    for (const NodePair& link : critical_links_)
      if (!drawn.count(link))
        fmt::format_to(std::back_inserter(buf_),
                       "  {} -> {} [style=bold, color=\"{}\", penwidth=3, constraint=false, "
                       "label=\"engine\"];\n",
                       node_id(link.first), node_id(link.second), kCritical);
  }

  // Rendezvous members joined by an undirected bold line that does not affect layout.
  void write_rendezvous() {
    std::set<NodePair> joined;
    for (GroupId g = 0; g < tasks_.group_count(); ++g) {
      std::uint32_t previous = kNoViewNode;
      bool labelled = false;
      for (TaskId m : tasks_.members(g)) {
        const std::uint32_t n = view_.node_of[m];
        if (n == kNoViewNode) continue;
        if (previous != kNoViewNode && previous != n &&
            joined.insert({std::min(previous, n), std::max(previous, n)}).second) {
          fmt::format_to(std::back_inserter(buf_),
                         "  {} -> {} [dir=none, style=bold, color=\"#756bb1\", constraint=false",
                         node_id(previous), node_id(n));
          if (per_task_ && !labelled) {
            buf_ += ", label=\"";
            detail::append_dot_escaped(buf_, tasks_.group_name(g));
            buf_ += '"';
            labelled = true;
          }
          buf_ += "];\n";
        }
        previous = n;
      }
    }
  }

  const TaskTable& tasks_;
  GraphView view_;
  bool per_task_;
  std::vector<bool> critical_nodes_;
  std::set<NodePair> critical_links_;
  std::string buf_;
};

}  // namespace

void write_dot(const Graph& graph, std::ostream& out, const DotOptions& options) {
  const std::string dot = DotWriter(graph, options).write();
  out.write(dot.data(), static_cast<std::streamsize>(dot.size()));
}

}  // namespace weave::rt
