#include "weave/devices/device_layout.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <hwloc.h>

#include <stdexcept>

namespace weave::devices {

std::vector<DevicePlacement> layout_devices(const Topology& topology, int devices) {
  std::vector<int> all(static_cast<std::size_t>(topology.cores()));
  for (int c = 0; c < topology.cores(); ++c)
    all[static_cast<std::size_t>(c)] = c;
  return layout_devices(topology, devices, all);
}

std::vector<DevicePlacement> layout_devices(const Topology& topology, int devices,
                                            const std::vector<int>& available) {
  if (devices < 1) {
    throw std::invalid_argument(fmt::format(
        "the number of devices must be at least 1 (got {}); pass --devices N", devices));
  }
  if (available.empty())
    throw std::invalid_argument("devices need at least one core to be laid out on");
  for (int c : available)
    if (c < 0 || c >= topology.cores())
      throw std::invalid_argument(fmt::format("core {} is not among this host's {} cores (0 to {})",
                                              c, topology.cores(), topology.cores() - 1));
  const int cores = static_cast<int>(available.size());
  const auto& core_list = topology.core_list();
  std::vector<DevicePlacement> layout(static_cast<std::size_t>(devices));
  if (devices <= cores) {
    // Blocks of consecutive cores, the first (cores % devices) devices one core larger.
    const int base = cores / devices, extra = cores % devices;
    int next = 0;
    for (int d = 0; d < devices; ++d) {
      const int size = base + (d < extra ? 1 : 0);
      for (int i = 0; i < size; ++i)
        layout[d].cores.push_back(available[static_cast<std::size_t>(next++)]);
    }
  } else {
    // More devices than cores: consecutive devices share a core.
    std::vector<int> sharing(static_cast<std::size_t>(cores), 0);
    for (int d = 0; d < devices; ++d) {
      const int core = static_cast<int>(static_cast<long long>(d) * cores / devices);
      layout[d].cores.push_back(available[static_cast<std::size_t>(core)]);
      ++sharing[static_cast<std::size_t>(core)];
    }
    for (int d = 0; d < devices; ++d)
      layout[d].sharing =
          sharing[static_cast<std::size_t>(static_cast<long long>(d) * cores / devices)];
  }
  for (int d = 0; d < devices; ++d) {
    layout[d].device = static_cast<rt::DeviceId>(d);
    layout[d].numa_node = core_list[layout[d].cores.front()].numa_node;
  }
  return layout;
}

std::vector<int> process_cores(const Topology& topology, int index, int count) {
  if (count < 1 || index < 0 || index >= count)
    throw std::invalid_argument(fmt::format(
        "process {} of {} on this host: the index must be in [0, count)", index, count));
  const int cores = topology.cores();
  std::vector<int> bound;
  if (!topology.is_synthetic()) {
    auto* handle = static_cast<hwloc_topology_t>(topology.hwloc_handle());
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (hwloc_get_cpubind(handle, set, HWLOC_CPUBIND_PROCESS) == 0) {
      for (const CoreInfo& c : topology.core_list())
        for (int pu : c.pus)
          if (hwloc_bitmap_isset(set, static_cast<unsigned>(pu))) {
            bound.push_back(c.index);
            break;
          }
    }
    hwloc_bitmap_free(set);
  }
  if (!bound.empty() && static_cast<int>(bound.size()) < cores) return bound;
  // Free to run anywhere: an equal block of the host for each process on it.
  std::vector<int> mine;
  if (count <= cores) {
    const int base = cores / count, extra = cores % count;
    const int first = index * base + std::min(index, extra);
    for (int c = first; c < first + base + (index < extra ? 1 : 0); ++c)
      mine.push_back(c);
  } else {
    mine.push_back(static_cast<int>(static_cast<long long>(index) * cores / count));
  }
  return mine;
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
