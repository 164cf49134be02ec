// The compiled form of a graph, shared by Graph copies, runs and traces.
#pragma once

#include <memory>
#include <vector>

#include "weave/runtime/graph.hpp"

namespace weave::rt::detail {

struct GraphData {
  std::shared_ptr<TaskTable> table;
  std::vector<TaskFn> work;
  // Successors in compressed rows: task t's are succ[succ_begin[t] .. succ_begin[t + 1]).
  std::vector<std::uint32_t> succ_begin;
  std::vector<TaskId> succ;
  std::vector<EdgeKind> succ_kind;
  std::vector<std::uint32_t> in_degree;
  std::vector<TaskId> sources;
  std::uint32_t sinks = 0;
};

struct GraphAccess {
  static const std::shared_ptr<const GraphData>& data(const Graph& g) { return g.data_; }
};

}  // namespace weave::rt::detail
