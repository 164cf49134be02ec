// What `weave train` and `weave predict` show of a step's graph: its DOT view (--dump-graph,
// --graph-filter, --graph-level) and its critical path on the virtual clock (--critical-path,
// --what-if) and, for a step weave train ran, on the wall clock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weave/graphs/step_report.hpp"
#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/critical_path.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/graph_view.hpp"
#include "weave/runtime/what_if.hpp"

namespace weave::cli {

struct TrainOptions;

// The flags read and checked before any work starts: a wrong filter, level or what-if is
// refused (std::invalid_argument naming the flag) before a step is built.
struct StepViewRequest {
  std::string dump_path;
  rt::GraphFilter filter;
  std::string level = "auto";
  bool critical_path = false;
  std::vector<rt::CostChange> what_if;
};
StepViewRequest step_view_request(const TrainOptions& o);

// `graph` replayed on `model` without running its work: the virtual-clock trace.
rt::Trace replay_costs(const rt::Graph& graph, const rt::CostModel& model);

// Prints the critical path of `trace` (a virtual-clock replay of `graph`); with what-ifs, and
// `changed` the replay of the same graph with those costs changed, the new step time and what
// moved. `stages`: each device's pipeline stage (graphs::pipeline_stage_of_devices), by which
// the pipeline's bubble is told apart. Returns the path's tasks, for the DOT.
std::vector<rt::TaskId> print_critical_path(const rt::Graph& graph, const rt::Trace& trace,
                                            const std::vector<rt::CostChange>& what_if,
                                            const rt::Trace& changed,
                                            const std::vector<int>& stages);

// Prints `path`, the critical path on the wall clock of a step weave train ran (rt::
// wall_critical_path of `trace`, the recorded spans of training iteration `iteration`), in
// print_critical_path's form, the host's waits between the steps a share of their own.
void print_wall_critical_path(const rt::CriticalPath& path, const rt::Trace& trace,
                              std::int64_t iteration, const std::vector<int>& stages);

// Writes the view of `graph` the request chooses, the critical path drawn heavy; returns what to
// tell the user ("graph: N tasks (layer level), written to PATH").
std::string write_graph_view(const rt::Graph& graph, const StepViewRequest& request,
                             const std::vector<rt::TaskId>& critical_path);

// --report: the step (`trace` a virtual-clock replay of `graph`) as one HTML page at `path`, its
// graph at the request's level (auto: a node per layer); returns what to tell the user
// ("report: ..., written to PATH").
std::string write_report(const std::string& path, const rt::Graph& graph, const rt::Trace& trace,
                         const StepViewRequest& request, graphs::StepReportInput input);

}  // namespace weave::cli
