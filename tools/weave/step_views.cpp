#include "step_views.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <stdexcept>

#include "memory_estimate.hpp"
#include "train_options.hpp"
#include "weave/graphs/path_bubble.hpp"
#include "weave/runtime/dot_writer.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::cli {

namespace {

// Above about this many nodes GraphViz takes more than seconds to lay a step's view out.
constexpr std::size_t kMostNodesDrawn = 400;

double ms(rt::Nanos t) {
  return static_cast<double>(t) * 1e-6;
}

double percent(rt::Nanos part, rt::Nanos whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

void print_shares(std::string_view title, const std::vector<rt::PathShare>& shares,
                  rt::Nanos length) {
  fmt::print("  {}:\n", title);
  for (const rt::PathShare& s : shares)
    fmt::print("    {:<36} {:>10.3f} ms  {:>5.1f} %\n", s.what, ms(s.time),
               percent(s.time, length));
}

// Consecutive steps on one device, printed as one run with its compute and communication time:
// the path moving between devices is where it waits for another stage or rank.
void print_runs(const rt::CriticalPath& path, const rt::TaskTable& tasks) {
  constexpr double kShownShare = 1.0;  // percent: shorter runs are counted, not listed
  std::size_t hidden = 0;
  rt::Nanos hidden_time = 0;
  fmt::print(
      "  the chain, in time order, a line per stay on one device ({:.0f} % of the step or "
      "more):\n",
      kShownShare);
  for (std::size_t i = 0; i < path.steps.size();) {
    const rt::DeviceId device = tasks[path.steps[i].task].device;
    std::size_t j = i;
    rt::Nanos compute = 0;
    for (; j < path.steps.size() && tasks[path.steps[j].task].device == device; ++j)
      if (tasks[path.steps[j].task].kind == rt::TaskKind::compute)
        compute += path.steps[j].end - path.steps[j].begin;
    // A stay's time runs from its first step's begin to its last's end, the waits between its
    // steps (wall clock) counted as other.
    const rt::Nanos time = path.steps[j - 1].end - path.steps[i].begin;
    if (percent(time, path.length) < kShownShare) {
      ++hidden;
      hidden_time += time;
    } else {
      fmt::print(
          "    {:>10.3f} ms  {:>5.1f} %  device {}: {} task{}, {:.3f} ms compute, {:.3f} ms "
          "other; '{}' .. '{}', after {}\n",
          ms(path.steps[i].begin - path.start), percent(time, path.length), device, j - i,
          j - i == 1 ? "" : "s", ms(compute), ms(time - compute), tasks.name(path.steps[i].task),
          tasks.name(path.steps[j - 1].task), rt::to_string(path.steps[i].waited_for));
    }
    i = j;
  }
  if (hidden > 0)
    fmt::print("    and {} shorter stays, {:.3f} ms ({:.1f} %)\n", hidden, ms(hidden_time),
               percent(hidden_time, path.length));
}

void print_what_if(const rt::Graph& graph, const std::vector<rt::CostChange>& changes,
                   const rt::Trace& changed, const rt::CriticalPath& before,
                   const rt::Trace& before_trace, const std::vector<int>& stages) {
  std::string spec;
  for (const rt::CostChange& c : changes)
    spec += (spec.empty() ? "" : ",") + c.describe();
  const rt::CriticalPath after = rt::critical_path(graph, changed);
  fmt::print("what-if {}: step {:.3f} ms -> {:.3f} ms ({:+.1f} %)\n", spec, ms(before.length),
             ms(after.length), percent(after.length - before.length, before.length));
  // What moved: each kind's time on the path before and after.
  const rt::CriticalPathSummary b = graphs::summarize_with_bubble(before, before_trace, stages);
  const rt::CriticalPathSummary a = graphs::summarize_with_bubble(after, changed, stages);
  auto time_of = [](const std::vector<rt::PathShare>& shares, const std::string& what) {
    for (const rt::PathShare& s : shares)
      if (s.what == what) return s.time;
    return rt::Nanos{0};
  };
  std::vector<std::string> kinds;
  for (const auto* list : {&b.by_kind, &a.by_kind})
    for (const rt::PathShare& s : *list)
      if (std::find(kinds.begin(), kinds.end(), s.what) == kinds.end()) kinds.push_back(s.what);
  fmt::print("  on the critical path, before -> after:\n");
  for (const std::string& k : kinds)
    fmt::print("    {:<36} {:>10.3f} ms -> {:>10.3f} ms\n", k, ms(time_of(b.by_kind, k)),
               ms(time_of(a.by_kind, k)));
}

}  // namespace

StepViewRequest step_view_request(const TrainOptions& o) {
  StepViewRequest r;
  r.dump_path = o.dump_graph;
  r.critical_path = o.critical_path;
  auto refused = [](std::string_view flag, const std::exception& e) {
    return std::invalid_argument(fmt::format("{}: {}", flag, e.what()));
  };
  try {
    r.filter = rt::parse_graph_filter(o.graph_filter);
  } catch (const std::invalid_argument& e) {
    throw refused("--graph-filter", e);
  }
  r.level = o.graph_level;
  if (r.level != "auto") {
    try {
      (void)rt::parse_detail_level(r.level);
    } catch (const std::invalid_argument& e) {
      throw refused("--graph-level", e);
    }
  }
  if (!o.what_if.empty()) {
    if (!o.critical_path)
      throw std::invalid_argument(
          fmt::format("--what-if {} compares against the step's critical path: add --critical-path",
                      o.what_if));
    try {
      r.what_if = rt::parse_cost_changes(o.what_if);
    } catch (const std::invalid_argument& e) {
      throw refused("--what-if", e);
    }
  }
  return r;
}

namespace {

// --graph-level auto: the finest level whose view has at most kMostNodesDrawn nodes (step
// level, a node per device and stream, when none has).
rt::DetailLevel finest_drawable_level(const rt::Graph& graph, const rt::GraphFilter& filter) {
  for (rt::DetailLevel level :
       {rt::DetailLevel::task, rt::DetailLevel::layer, rt::DetailLevel::stage_micro_batch}) {
    std::size_t nodes = 0;
    if (level == rt::DetailLevel::task) {
      for (rt::TaskId t = 0; t < graph.size(); ++t)
        nodes += filter.selects(graph.tasks(), t) ? 1 : 0;
    } else {
      nodes = rt::view_graph(graph, {.filter = filter, .level = level}).nodes.size();
    }
    if (nodes <= kMostNodesDrawn) return level;
  }
  return rt::DetailLevel::step;
}

}  // namespace

rt::Trace replay_costs(const rt::Graph& graph, const rt::CostModel& model) {
  rt::VirtualClock clock(model, {.execute = false, .record_trace = true});
  return clock.run(graph).trace;
}

std::vector<rt::TaskId> print_critical_path(const rt::Graph& graph, const rt::Trace& trace,
                                            const std::vector<rt::CostChange>& what_if,
                                            const rt::Trace& changed,
                                            const std::vector<int>& stages) {
  const rt::CriticalPath path = rt::critical_path(graph, trace);
  const rt::CriticalPathSummary summary = graphs::summarize_with_bubble(path, trace, stages);
  fmt::print("critical path: {} steps, {:.3f} ms = the step time on the virtual clock\n",
             path.steps.size(), ms(path.length));
  print_shares("by kind", summary.by_kind, path.length);
  print_shares("by what the next step waited for", summary.by_wait, path.length);
  print_runs(path, graph.tasks());
  if (!what_if.empty()) print_what_if(graph, what_if, changed, path, trace, stages);
  return path.tasks();
}

void print_wall_critical_path(const rt::CriticalPath& path, const rt::Trace& trace,
                              std::int64_t iteration, const std::vector<int>& stages) {
  const rt::CriticalPathSummary summary = graphs::summarize_with_bubble(path, trace, stages);
  fmt::print(
      "critical path on the wall clock, iteration {}: {} steps, {:.3f} ms = the step's tasks from "
      "the first one's start to the last one's end\n",
      iteration, path.steps.size(), ms(path.length));
  print_shares("by kind", summary.by_kind, path.length);
  print_shares("by what the next step waited for", summary.by_wait, path.length);
  print_runs(path, trace.tasks());
}

std::string write_graph_view(const rt::Graph& graph, const StepViewRequest& request,
                             const std::vector<rt::TaskId>& critical_path) {
  rt::DotOptions options{.view = {.filter = request.filter}, .critical_path = critical_path};
  std::size_t shown = 0;
  for (rt::TaskId t = 0; t < graph.size(); ++t)
    shown += request.filter.selects(graph.tasks(), t) ? 1 : 0;
  options.view.level = request.level == "auto" ? finest_drawable_level(graph, request.filter)
                                               : rt::parse_detail_level(request.level);
  std::ofstream dot(request.dump_path, std::ios::trunc);
  rt::write_dot(graph, dot, options);
  dot.close();
  if (!dot)
    throw std::runtime_error(fmt::format("--dump-graph: writing '{}' failed", request.dump_path));
  return fmt::format("graph: {} of {} tasks at {} level, written to {}", shown, graph.size(),
                     rt::to_string(options.view.level), request.dump_path);
}

std::string write_report(const std::string& path, const rt::Graph& graph, const rt::Trace& trace,
                         const StepViewRequest& request, graphs::StepReportInput input) {
  input.level =
      request.level == "auto" ? rt::DetailLevel::layer : rt::parse_detail_level(request.level);
  const std::size_t bytes = graphs::write_step_report(path, graph, trace, input);
  return fmt::format("report: {} tasks, {}, written to {}", graph.size(),
                     bytes_text(static_cast<std::int64_t>(bytes)), path);
}

}  // namespace weave::cli
