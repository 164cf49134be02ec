// GraphViz DOT of a graph's view (graph_view.hpp): a cluster per device and one per stream inside
// it, nodes coloured by task kind (a merged node by its most common kind), stream order drawn as
// dashed edges, event edges dotted, paths through filtered-out tasks dashed purple, and the
// critical path, when given, in heavy red.
#pragma once

#include <iosfwd>
#include <vector>

#include "weave/runtime/graph.hpp"
#include "weave/runtime/graph_view.hpp"

namespace weave::rt {

struct DotOptions {
  GraphViewOptions view;
  // Tasks in the order they set the step's time (critical_path.hpp); empty: none drawn.
  std::vector<TaskId> critical_path;
};

void write_dot(const Graph& graph, std::ostream& out, const DotOptions& options = {});

}  // namespace weave::rt
