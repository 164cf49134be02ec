// `weave topo`: the host's topology and where each simulated device runs.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "commands.hpp"
#include "weave/devices/device_layout.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/devices/topology.hpp"

namespace weave::cli {

namespace {

struct TopoOptions {
  int devices = 0;  // 0: one per core
  std::vector<int> synthetic;
  bool json = false;
  bool links = false;
};

int run_topo(const TopoOptions& o) {
  if (o.links) {
    for (const auto& p : devices::LinkModel::presets()) {
      fmt::print("{:<14} {}\n", p.name, p.description);
    }
    return 0;
  }
  devices::Topology topology = [&] {
    if (o.synthetic.empty()) return devices::Topology::detect();
    if (o.synthetic.size() < 3 || o.synthetic.size() > 4) {
      throw std::invalid_argument(fmt::format(
          "--synthetic takes PACKAGES,NUMA_PER_PACKAGE,CORES_PER_NUMA[,PUS_PER_CORE] (got {} "
          "numbers), e.g. --synthetic 2,2,16",
          o.synthetic.size()));
    }
    return devices::Topology::synthetic(o.synthetic[0], o.synthetic[1], o.synthetic[2],
                                        o.synthetic.size() == 4 ? o.synthetic[3] : 1);
  }();
  const int count = o.devices > 0 ? o.devices : topology.cores();
  const auto layout = devices::layout_devices(topology, count);
  if (o.json) {
    nlohmann::json cores = nlohmann::json::array();
    for (const auto& c : topology.core_list()) {
      cores.push_back({{"index", c.index},
                       {"os_index", c.os_index},
                       {"package", c.package},
                       {"numa_node", c.numa_node},
                       {"pus", c.pus}});
    }
    nlohmann::json devices = nlohmann::json::array();
    for (const auto& p : layout) {
      std::vector<int> os;
      for (int c : p.cores)
        os.push_back(topology.core_list()[c].os_index);
      devices.push_back({{"device", p.device},
                         {"cores", os},
                         {"numa_node", p.numa_node},
                         {"sharing", p.sharing},
                         {"concurrency", p.sharing > 1 ? 1 : static_cast<int>(p.cores.size())}});
    }
    const nlohmann::json out = {{"synthetic", topology.is_synthetic()},
                                {"packages", topology.packages()},
                                {"numa_nodes", topology.numa_nodes()},
                                {"cores", topology.cores()},
                                {"pus", topology.pus()},
                                {"core_list", cores},
                                {"devices", devices}};
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  fmt::print("{}", topology.describe());
  fmt::print("{} device(s), {}:\n", count,
             count <= topology.cores() ? "each on its own block of cores"
                                       : "more devices than cores, so devices share cores");
  fmt::print("{}", devices::describe_layout(topology, layout));
  return 0;
}

}  // namespace

void add_topo_command(CLI::App& app) {
  auto options = std::make_shared<TopoOptions>();
  CLI::App* cmd = app.add_subcommand("topo", "Show the host topology and the device -> cores map");
  cmd->add_option("--devices", options->devices, "Simulated devices (default: one per core)")
      ->check(at_least(1));
  cmd->add_option("--synthetic", options->synthetic,
                  "Lay out on a made-up host: PACKAGES,NUMA_PER_PACKAGE,CORES_PER_NUMA[,PUS]")
      ->delimiter(',');
  cmd->add_flag("--json", options->json, "Print as JSON");
  cmd->add_flag("--links", options->links, "List the link-model presets");
  cmd->footer(
      "Example:\n"
      "  weave topo --devices 8\n"
      "  weave topo --synthetic 2,2,16 --devices 8 --json   (a made-up host of 64 cores)");
  cmd->callback([options] { throw CommandExit{run_topo(*options)}; });
}

}  // namespace weave::cli
