#include "weave/devices/device_layout.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace weave::devices {

std::vector<DevicePlacement> layout_devices(const Topology& topology, int devices) {
  if (devices < 1) {
    throw std::invalid_argument(fmt::format(
        "the number of devices must be at least 1 (got {}); pass --devices N", devices));
  }
  const int cores = topology.cores();
  const auto& core_list = topology.core_list();
  std::vector<DevicePlacement> layout(static_cast<std::size_t>(devices));
  if (devices <= cores) {
    // Blocks of consecutive cores, the first (cores % devices) devices one core larger.
    const int base = cores / devices, extra = cores % devices;
    int next = 0;
    for (int d = 0; d < devices; ++d) {
      const int size = base + (d < extra ? 1 : 0);
      for (int i = 0; i < size; ++i)
        layout[d].cores.push_back(next++);
    }
  } else {
    // More devices than cores: consecutive devices share a core.
    std::vector<int> sharing(static_cast<std::size_t>(cores), 0);
    for (int d = 0; d < devices; ++d) {
      const int core = static_cast<int>(static_cast<long long>(d) * cores / devices);
      layout[d].cores.push_back(core);
      ++sharing[core];
    }
    for (auto& p : layout)
      p.sharing = sharing[p.cores.front()];
  }
  for (int d = 0; d < devices; ++d) {
    layout[d].device = static_cast<rt::DeviceId>(d);
    layout[d].numa_node = core_list[layout[d].cores.front()].numa_node;
  }
  return layout;
}

std::string describe_layout(const Topology& topology, const std::vector<DevicePlacement>& layout) {
  std::string s;
  for (const DevicePlacement& p : layout) {
    std::vector<int> os;
    for (int c : p.cores)
      os.push_back(topology.core_list()[c].os_index);
    s += fmt::format("  device {:>3} -> core(s) {:<12} NUMA {}{}\n", p.device,
                     fmt::format("{}", fmt::join(os, ",")), p.numa_node,
                     p.sharing > 1
                         ? fmt::format("  (shares its core with {} other device(s))", p.sharing - 1)
                         : "");
  }
  return s;
}

}  // namespace weave::devices
