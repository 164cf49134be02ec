// One training step as a page a person opens (weave train and weave predict --report): a single
// HTML file, its script and style inlined and nothing fetched, holding one JSON document of the
// step and the script that draws it: every device's and stream's timeline, the graph at layer
// level whose nodes expand into their tasks, the critical path in both, exposed communication per
// process group, memory per device by category, and the run's configuration.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "weave/graphs/memory_timeline.hpp"
#include "weave/runtime/critical_path.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/graph_view.hpp"
#include "weave/runtime/memory_tracker.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::graphs {

// The most tasks a page holds: each is a column entry of the document (about 150 bytes) and a
// box the browser draws, so 100,000 make a page of some 15 MB that still opens in seconds.
inline constexpr std::size_t kStepReportMostTasks = 100'000;

// Throws std::invalid_argument, naming the size and what to do instead, when a step of `tasks`
// tasks is more than a page holds: called with the task count as soon as the step is built,
// before it is replayed or trained, so that a step too large is refused in seconds.
void check_report_size(std::size_t tasks, std::size_t most_tasks = kStepReportMostTasks);

struct StepReportInput {
  std::string title;  // "weave predict", shown at the top
  // The graph's level of detail: a node per layer by default (--graph-level chooses).
  rt::DetailLevel level = rt::DetailLevel::layer;
  // The run's configuration as a JSON object (the flag table's description of it).
  std::string configuration_json = "{}";
  // Per device, its pipeline stage (pipeline_stage_of_devices): the critical path's bubble is
  // told apart by it (every device stage 0 when empty).
  std::vector<int> stage_of_device;
  // Per device, each rt::MemoryCategory's bytes at its peak, and what they are (a prediction's
  // trackers, a run's own): the trackers keep peaks, not a history, so the page shows the peak.
  std::vector<std::array<std::int64_t, rt::kMemoryCategoryCount>> memory;
  std::string memory_source;
  // Per device, its memory over the step by category on `trace`'s clock (memory_timeline; a
  // prediction's memory_over_step): drawn as a chart per device under the timeline. Empty: the
  // page shows the peaks alone.
  MemoryTimeline memory_over_step;
  // A run's critical path on the wall clock (rt::wall_critical_path of `wall_trace`, the spans of
  // training iteration `wall_iteration` of the same graph): shown beside the virtual clock's.
  // Empty (no steps): the page says a prediction has none.
  rt::CriticalPath wall_critical_path;
  rt::Trace wall_trace;
  std::int64_t wall_iteration = 0;
  // A step of more tasks is refused (std::invalid_argument naming its size and what to do).
  std::size_t most_tasks = kStepReportMostTasks;
};

// The step's JSON document: `trace` must be a virtual-clock replay of `graph` (the critical path
// is read from it). Its fields:
//   clock, makespan_ns; devices (those holding a task); streams [{id, name, group}] (group:
//   the process group the stream serves, "compute" for the compute stream); lanes [{device,
//   stream}] with a task;
//   tasks, one array per field, indexed by task id: name, device, stream, kind, layer,
//   micro_batch, chunk, phase, start, end (ns; -1 for a task that did not run);
//   graph {level, nodes [{device, stream, layer, micro_batch, phase, tasks}], edges [[from, to,
//   count]]}: every task in exactly one node;
//   critical_path {length_ns, steps [{task, last_member, begin, end, waited_for, bubble_ns}],
//   by_kind [{what, ns}]} (summarize_with_bubble's);
//   wall_critical_path (null without one) {iteration, start_ns, length_ns, steps [{task,
//   last_member, begin, end, waited, waited_for}], by_kind, by_wait};
//   exposed [{group, ns, ms_per_device}]; memory {shows: "peak", source, categories, devices,
//   over_step [{at [ns], bytes [[per category]]}] per device, empty without a timeline};
//   configuration; title.
std::string step_report_json(const rt::Graph& graph, const rt::Trace& trace,
                             const StepReportInput& input);

// The page with `json` (step_report_json's) inlined.
std::string step_report_page(const std::string& json);

// Writes the page of `graph` and its replay `trace` to `path`; throws std::runtime_error naming
// the path when it cannot be written. Returns the page's size in bytes.
std::size_t write_step_report(const std::string& path, const rt::Graph& graph,
                              const rt::Trace& trace, const StepReportInput& input);

}  // namespace weave::graphs
