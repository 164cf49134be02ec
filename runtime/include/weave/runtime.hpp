// weave's runtime: task graphs (GraphBuilder, Graph), the Executor on the wall clock with its
// eager streams and events, the VirtualClock, traces (Chrome JSON written and read, metrics,
// DOT) and the MemoryTracker. Knows nothing of machine learning. See docs/api.md.
#pragma once

#include "weave/runtime/chrome_trace.hpp"
#include "weave/runtime/completion.hpp"
#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/critical_path.hpp"
#include "weave/runtime/dot_writer.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/event.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/graph_view.hpp"
#include "weave/runtime/memory_tracker.hpp"
#include "weave/runtime/stream.hpp"
#include "weave/runtime/task_context.hpp"
#include "weave/runtime/task_table.hpp"
#include "weave/runtime/trace.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/types.hpp"
#include "weave/runtime/virtual_clock.hpp"
#include "weave/runtime/what_if.hpp"
