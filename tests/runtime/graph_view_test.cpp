// Views of a graph: filters select exactly the tasks they name, and collapsing to any level of
// detail keeps reachability between the merged nodes; the DOT of a view draws what it holds.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "random_step_graph.hpp"
#include "weave/runtime/dot_writer.hpp"
#include "weave/runtime/graph_view.hpp"

namespace weave::rt {
namespace {

// Written apart from GraphFilter::selects: what each filter below names, read off the tags.
bool named_by(const std::string& spec, const TaskTable& tasks, TaskId t) {
  const TaskInfo& i = tasks[t];
  const std::string stream(tasks.stream_name(i.stream));
  if (spec == "") return true;
  if (spec == "device=1") return i.device == 1;
  if (spec == "stream=tp") return stream == "tp";
  if (spec == "layer=2,phase=B") return i.tags.layer == 2 && i.tags.phase == Phase::backward;
  if (spec == "micro-batch=0,micro-batch=2")
    return i.tags.micro_batch != 1 && i.tags.micro_batch >= 0;
  if (spec == "chunk=1,device=0") return i.tags.chunk == 1 && i.device == 0;
  if (spec == "phase=F,stream=compute")
    return i.tags.phase == Phase::forward && stream == "compute";
  throw std::logic_error("no such filter in the test");
}

const std::vector<std::string> kFilters = {"",
                                           "device=1",
                                           "stream=tp",
                                           "layer=2,phase=B",
                                           "micro-batch=0,micro-batch=2",
                                           "chunk=1,device=0",
                                           "phase=F,stream=compute"};
const DetailLevel kLevels[] = {DetailLevel::task, DetailLevel::layer,
                               DetailLevel::stage_micro_batch, DetailLevel::step};

// Nodes reached from `from` along the view's edges.
std::vector<bool> view_reach(const GraphView& v, std::uint32_t from) {
  std::vector<bool> seen(v.nodes.size(), false);
  std::vector<std::uint32_t> todo{from};
  while (!todo.empty()) {
    const std::uint32_t n = todo.back();
    todo.pop_back();
    for (const ViewEdge& e : v.edges)
      if (e.from == n && !seen[e.to]) todo.push_back(e.to), seen[e.to] = true;
  }
  return seen;
}

// Nodes reached from `from` in the task graph, a node's tasks merged into one and left-out
// tasks passed through.
std::vector<bool> task_reach(const Graph& g, const GraphView& v, std::uint32_t from) {
  std::vector<bool> seen_node(v.nodes.size(), false), seen_task(g.size(), false);
  std::vector<TaskId> todo(v.nodes[from].tasks.begin(), v.nodes[from].tasks.end());
  while (!todo.empty()) {
    const TaskId t = todo.back();
    todo.pop_back();
    for (TaskId s : g.successors(t)) {
      if (seen_task[s]) continue;
      seen_task[s] = true;
      const std::uint32_t n = v.node_of[s];
      if (n == kNoViewNode) {
        todo.push_back(s);
      } else if (!seen_node[n]) {
        seen_node[n] = true;
        for (TaskId m : v.nodes[n].tasks)
          if (!seen_task[m] || m == s) todo.push_back(m), seen_task[m] = true;
      }
    }
  }
  return seen_node;
}

TEST(GraphView, FiltersSelectExactlyTheTasksTheyName) {
  const Graph g = testing::random_step_graph(7);
  for (const std::string& spec : kFilters) {
    const GraphView v = view_graph(g, {.filter = parse_graph_filter(spec)});
    std::size_t shown = 0;
    for (TaskId t = 0; t < g.size(); ++t) {
      EXPECT_EQ(v.node_of[t] != kNoViewNode, named_by(spec, g.tasks(), t)) << spec << " task " << t;
      shown += v.node_of[t] != kNoViewNode;
    }
    if (spec != "") {
      EXPECT_LT(shown, g.size()) << spec;
    }
    EXPECT_GT(shown, 0u) << spec;
  }
}

TEST(GraphView, CollapsingKeepsReachabilityAtEveryLevelAndFilter) {
  for (unsigned seed : {1u, 2u, 3u}) {
    const Graph g = testing::random_step_graph(seed);
    for (DetailLevel level : kLevels)
      for (const std::string& spec : kFilters) {
        const GraphView v = view_graph(g, {.filter = parse_graph_filter(spec), .level = level});
        for (std::uint32_t a = 0; a < v.nodes.size(); ++a) {
          const std::vector<bool> drawn = view_reach(v, a), real = task_reach(g, v, a);
          for (std::uint32_t b = 0; b < v.nodes.size(); ++b)
            if (a != b) {
              ASSERT_EQ(drawn[b], real[b]) << "seed " << seed << ", level " << to_string(level)
                                           << ", filter '" << spec << "': nodes " << a << ", " << b;
            }
        }
      }
  }
}

TEST(GraphView, NodesMergeTheTasksThatShareTheLevelsTags) {
  const Graph g = testing::random_step_graph(4);
  const TaskTable& tasks = g.tasks();
  const GraphView layers = view_graph(g, {.level = DetailLevel::layer});
  const GraphView steps = view_graph(g, {.level = DetailLevel::step});
  std::size_t merged = 0;
  for (const ViewNode& n : layers.nodes)
    for (TaskId t : n.tasks) {
      EXPECT_EQ(tasks[t].device, n.device);
      EXPECT_EQ(tasks[t].stream, n.stream);
      EXPECT_EQ(tasks[t].tags.layer, n.layer);
      EXPECT_EQ(tasks[t].tags.phase, n.phase);
      ++merged;
    }
  EXPECT_EQ(merged, g.size());
  EXPECT_LT(layers.nodes.size(), g.size());
  EXPECT_EQ(steps.nodes.size(), 3u * 4u);  // 3 devices x 4 streams
  std::size_t summed = 0;
  for (const ViewEdge& e : steps.edges)
    summed += e.count;
  std::size_t crossing = 0;
  for (TaskId t = 0; t < g.size(); ++t)
    for (TaskId s : g.successors(t))
      crossing += steps.node_of[t] != steps.node_of[s];
  EXPECT_EQ(summed, crossing);
}

TEST(GraphView, WrongFiltersAndLevelsAreRefusedNamingTheFix) {
  EXPECT_THROW(parse_graph_filter("colour=red"), std::invalid_argument);
  EXPECT_THROW(parse_graph_filter("layer=x"), std::invalid_argument);
  EXPECT_THROW(parse_graph_filter("phase=Q"), std::invalid_argument);
  EXPECT_THROW(parse_graph_filter("device"), std::invalid_argument);
  EXPECT_THROW(parse_detail_level("stage"), std::invalid_argument);
  try {
    parse_detail_level("stage");
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("stage-micro-batch"), std::string::npos);
  }
  EXPECT_EQ(parse_detail_level("stage-micro-batch"), DetailLevel::stage_micro_batch);
}

TEST(Dot, CollapsedViewDrawsANodePerMergedGroupAndHighlightsTheCriticalPath) {
  const Graph g = testing::random_step_graph(5);
  const GraphView v = view_graph(g, {.level = DetailLevel::layer});
  std::vector<TaskId> path = {v.nodes[0].tasks.front(), v.nodes[1].tasks.front()};
  std::ostringstream out;
  write_dot(g, out, {.view = {.level = DetailLevel::layer}, .critical_path = path});
  const std::string dot = out.str();
  for (std::size_t n = 0; n < v.nodes.size(); ++n)
    EXPECT_NE(dot.find(fmt::format("  n{} [label=", n)), std::string::npos) << n;
  EXPECT_EQ(dot.find(" t0 "), std::string::npos);
  EXPECT_NE(dot.find("n0 -> n1 ["), std::string::npos);
  EXPECT_NE(dot.find("penwidth=3"), std::string::npos);
  EXPECT_EQ(std::count(dot.begin(), dot.end(), '{'), std::count(dot.begin(), dot.end(), '}'));
}

}  // namespace
}  // namespace weave::rt
