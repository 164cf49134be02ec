// GraphViz DOT of a graph: one cluster per device, nodes coloured by task kind, stream order
// drawn as dashed edges and event edges dotted.
#pragma once

#include <iosfwd>

#include "weave/runtime/graph.hpp"

namespace weave::rt {

void write_dot(const Graph& graph, std::ostream& out);

}  // namespace weave::rt
