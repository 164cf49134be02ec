// `weave simulate`: runs a synthetic workload on the wall clock, the virtual clock or both,
// and reports busy, communication and exposed-communication time per device.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "commands.hpp"
#include "output_paths.hpp"
#include "synthetic_workload.hpp"
#include "weave/devices/device_layout.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/runtime/chrome_trace.hpp"
#include "weave/runtime/dot_writer.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::cli {

namespace {

struct SimulateOptions {
  WorkloadOptions workload;
  std::string link = "none";
  double device_flops = 1e11;
  std::string timing = "both";
  int iterations = 3;
  std::string trace_path;
  std::string dot_path;
  bool json = false;
};

struct ClockReport {
  std::string clock;
  rt::TraceMetrics metrics;
};

nlohmann::json to_json(const ClockReport& r) {
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& d : r.metrics.devices) {
    devices.push_back({{"compute_ns", d.compute_busy},
                       {"comm_ns", d.comm_busy},
                       {"exposed_comm_ns", d.exposed_comm},
                       {"busy_ns", d.busy},
                       {"idle_fraction", d.idle_fraction}});
  }
  return {{"clock", r.clock},
          {"makespan_ns", r.metrics.makespan},
          {"exposed_comm_share", r.metrics.exposed_comm_share()},
          {"devices", devices}};
}

void print(const ClockReport& r) {
  const auto& m = r.metrics;
  const double n = static_cast<double>(std::max<std::size_t>(1, m.devices.size()));
  double idle = 0;
  for (const auto& d : m.devices)
    idle += d.idle_fraction;
  fmt::print(
      "{:<8} makespan {:>10.3f} ms | per device: compute {:>9.3f} ms, comm {:>9.3f} ms, "
      "exposed comm {:>9.3f} ms ({:.1f}% of busy), idle {:.1f}%\n",
      r.clock, m.makespan * 1e-6, m.total_compute() * 1e-6 / n, m.total_comm() * 1e-6 / n,
      m.total_exposed_comm() * 1e-6 / n, 100 * m.exposed_comm_share(), 100 * idle / n);
}

std::string trace_path_for(const SimulateOptions& o, const std::string& clock) {
  if (o.trace_path.empty() || o.timing != "both") return o.trace_path;
  const std::filesystem::path p(o.trace_path);
  return (p.parent_path() / (p.stem().string() + "." + clock + p.extension().string())).string();
}

// The trace files the run writes, by clock: one, or NAME.wall.json and NAME.model.json.
std::vector<std::string> trace_paths(const SimulateOptions& o) {
  if (o.trace_path.empty()) return {};
  if (o.timing != "both") return {o.trace_path};
  return {trace_path_for(o, "wall"), trace_path_for(o, "model")};
}

void write_dot_file(const rt::Graph& graph, const std::string& path) {
  std::ofstream dot(path, std::ios::trunc);
  rt::write_dot(graph, dot);
  dot.close();
  if (!dot) throw std::runtime_error(fmt::format("--dump-graph: writing '{}' failed", path));
}

int run_simulate(const SimulateOptions& o) {
  for (const std::string& path : trace_paths(o))
    check_writable("--trace", path);
  check_writable("--dump-graph", o.dot_path);
  const devices::LinkModel links = devices::LinkModel::preset(o.link);
  std::vector<ClockReport> reports;

  if (o.timing == "wall" || o.timing == "both") {
    devices::DeviceSet set(o.workload.devices);
    Workload w = build_workload(o.workload, &set);
    std::vector<int> numa;
    for (const auto& p : set.layout())
      numa.push_back(p.numa_node);
    const devices::MachineModel model(numa, o.device_flops, links);
    rt::RunOptions run{.link_model = links.enabled() ? &model : nullptr};
    for (int i = 1; i < o.iterations; ++i)
      set.executor().run(w.graph, run);  // warm-up
    run.record_trace = true;
    const rt::RunResult result = set.executor().run(w.graph, run);
    reports.push_back({"wall", rt::measure(result.trace)});
    if (!o.trace_path.empty()) rt::write_chrome_trace(result.trace, trace_path_for(o, "wall"));
    if (!o.dot_path.empty()) write_dot_file(w.graph, o.dot_path);
  }
  if (o.timing == "model" || o.timing == "both") {
    const Workload w = build_workload(o.workload, nullptr);
    const auto layout = devices::layout_devices(devices::Topology::detect(), o.workload.devices);
    std::vector<int> numa;
    for (const auto& p : layout)
      numa.push_back(p.numa_node);
    const devices::MachineModel model(numa, o.device_flops, links);
    rt::VirtualClock clock(model);
    const rt::VirtualRunResult result = clock.run(w.graph);
    reports.push_back({"virtual", rt::measure(result.trace)});
    if (!o.trace_path.empty()) rt::write_chrome_trace(result.trace, trace_path_for(o, "model"));
    if (!o.dot_path.empty() && o.timing == "model") write_dot_file(w.graph, o.dot_path);
  }

  if (o.json) {
    nlohmann::json out = {{"workload", o.workload.shape},
                          {"devices", o.workload.devices},
                          {"link", links.name()},
                          {"clocks", nlohmann::json::array()}};
    for (const auto& r : reports)
      out["clocks"].push_back(to_json(r));
    if (!o.trace_path.empty()) out["traces"] = trace_paths(o);
    std::cout << out.dump(2) << "\n";
  } else {
    fmt::print("workload {} on {} devices, link {}\n", o.workload.shape, o.workload.devices,
               links.describe());
    for (const auto& r : reports)
      print(r);
    if (!o.trace_path.empty()) fmt::print("trace: {}\n", fmt::join(trace_paths(o), ", "));
    if (!o.dot_path.empty()) fmt::print("graph: {}\n", o.dot_path);
  }
  return 0;
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto options = std::make_shared<SimulateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "simulate", "Run a synthetic workload on the wall clock and/or the virtual clock");
  auto& w = options->workload;
  cmd->add_option("--workload", w.shape, "overlap | chain | fanout | wavefront")
      ->check(CLI::IsMember(workload_shapes()))
      ->capture_default_str();
  cmd->add_option("--devices", w.devices, "Simulated devices")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--layers", w.layers, "overlap: layers")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--chunks", w.chunks, "overlap: chunks per layer")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--flops", w.flops_per_task, "FLOPs per compute task")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--bytes", w.bytes_per_exchange, "overlap: bytes per device per layer exchanged")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--size", w.size, "chain/fanout: tasks; wavefront: side")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--link", options->link,
                  "Link model: a preset (see `weave topo --links`) or GBPS:MICROSECONDS")
      ->capture_default_str();
  cmd->add_option("--device-flops", options->device_flops,
                  "Modelled compute rate of a device, FLOP/s (virtual clock)")
      ->check(positive())
      ->capture_default_str();
  cmd->add_option("--timing", options->timing, "wall | model | both")
      ->check(CLI::IsMember({"wall", "model", "both"}))
      ->capture_default_str();
  cmd->add_option("--iterations", options->iterations, "Wall clock: runs, the last one traced")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--trace", options->trace_path,
                  "Write the Chrome trace here (with --timing both: NAME.wall.json and "
                  "NAME.model.json)");
  cmd->add_option("--dump-graph", options->dot_path, "Write the graph as GraphViz DOT here");
  cmd->add_flag("--json", options->json, "Print the report as JSON");
  cmd->footer(
      "Example:\n"
      "  weave simulate --workload overlap --devices 4 --link ampipe-20gbps --timing both \\\n"
      "                 --trace sim.json   (writes sim.wall.json and sim.model.json)");
  cmd->callback([options] { throw CommandExit{run_simulate(*options)}; });
}

}  // namespace weave::cli
