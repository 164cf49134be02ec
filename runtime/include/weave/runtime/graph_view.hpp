// A view of a graph a person can read: the tasks a filter selects, collapsed to a level of detail.
//
// A step of a real model has thousands of tasks (a prediction's, millions); drawn one node per
// task, GraphViz cannot lay it out. A view keeps the tasks a filter names (device, stream, layer,
// micro-batch, chunk, phase: the task's placement and tags) and merges them into nodes by the
// level of detail: one per task, per (device, stream, layer, phase), per (device, stream,
// micro-batch, phase) or per (device, stream). Edges between the merged tasks are summed.
//
// Reachability is kept: a view has a path from node A to node B exactly when the task graph has
// a path from a task of A to a task of B in which the tasks of one node count as one (they were
// merged) and the tasks the filter left out may be passed through. A path that runs only through
// left-out tasks becomes an edge of its own, marked `hidden`.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weave/runtime/graph.hpp"

namespace weave::rt {

enum class DetailLevel : std::uint8_t {
  task,               // a node per task
  layer,              // a node per device, stream, layer and phase
  stage_micro_batch,  // a node per device, stream, micro-batch and phase
  step,               // a node per device and stream
};

// "task", "layer", "stage-micro-batch" or "step"; throws std::invalid_argument naming the levels.
DetailLevel parse_detail_level(std::string_view word);
std::string_view to_string(DetailLevel level);

// The tasks to show. An empty list places no condition; a task is shown when every non-empty
// list holds its value (device id, stream name, layer, micro-batch, chunk tag, phase).
struct GraphFilter {
  std::vector<DeviceId> devices;
  std::vector<std::string> streams;
  std::vector<std::int32_t> layers;
  std::vector<std::int32_t> micro_batches;
  std::vector<std::int32_t> chunks;
  std::vector<Phase> phases;

  bool empty() const;
  bool selects(const TaskTable& tasks, TaskId task) const;
};

// Parses "device=0,layer=3,phase=F" (keys: device, stream, layer, micro-batch, chunk, phase;
// phase F, B or W; a key may repeat to allow several values). Throws std::invalid_argument
// naming the key or value that is wrong and the accepted ones.
GraphFilter parse_graph_filter(std::string_view spec);

struct GraphViewOptions {
  GraphFilter filter;
  DetailLevel level = DetailLevel::task;
};

inline constexpr std::uint32_t kNoViewNode = 0xffffffffu;

// Tasks merged into one node: they share the device, the stream and the level's tags (-1 and
// Phase::none where the level does not look at a tag).
struct ViewNode {
  DeviceId device = 0;
  StreamId stream = kComputeStream;
  std::int32_t layer = -1;
  std::int32_t micro_batch = -1;
  Phase phase = Phase::none;
  std::vector<TaskId> tasks;  // ascending
};

struct ViewEdge {
  std::uint32_t from = 0;
  std::uint32_t to = 0;
  std::uint32_t count = 0;  // task edges summed into this one (0 for a hidden path)
  // Every summed task edge was stream order (drawn dashed), or every one an event.
  bool all_stream_order = false;
  bool all_event = false;
  bool hidden = false;  // the tasks connect only through tasks the filter left out
};

struct GraphView {
  DetailLevel level = DetailLevel::task;
  std::vector<ViewNode> nodes;         // ordered by device, stream, then first task
  std::vector<ViewEdge> edges;         // ordered by (from, to); no self-loops
  std::vector<std::uint32_t> node_of;  // per task: its node, or kNoViewNode if filtered out
};

GraphView view_graph(const Graph& graph, const GraphViewOptions& options = {});

}  // namespace weave::rt
