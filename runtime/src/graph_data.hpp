// The compiled form of a graph, shared by Graph copies, runs and traces.
#pragma once

#include <memory>
#include <vector>

#include "weave/runtime/graph.hpp"
#include "weave/runtime/huge_page_allocator.hpp"
#include "weave/runtime/segmented_array.hpp"

namespace weave::rt::detail {

// The arrays that grow with the task or edge count.
template <class T>
using LargeArray = std::vector<T, HugePageAllocator<T>>;

struct GraphData {
  std::shared_ptr<TaskTable> table;
  // Filled as the builder adds tasks and handed over whole (never moved element by element).
  SegmentedArray<TaskFn> work;
  // Successors in compressed rows: task t's are succ[succ_begin[t] .. succ_begin[t + 1]).
  LargeArray<std::uint32_t> succ_begin;
  LargeArray<TaskId> succ;
  LargeArray<EdgeKind> succ_kind;
  LargeArray<std::uint32_t> in_degree;
  std::vector<TaskId> sources;
  std::uint32_t sinks = 0;
};

struct GraphAccess {
  static const std::shared_ptr<const GraphData>& data(const Graph& g) { return g.data_; }
};

}  // namespace weave::rt::detail
