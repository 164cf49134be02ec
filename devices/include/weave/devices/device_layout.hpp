// Where N devices go on a host: blocks of consecutive cores, so that a device stays inside one
// NUMA node whenever the counts allow; with more devices than cores, devices share cores.
#pragma once

#include <string>
#include <vector>

#include "weave/devices/topology.hpp"
#include "weave/runtime/types.hpp"

namespace weave::devices {

struct DevicePlacement {
  rt::DeviceId device = 0;
  std::vector<int> cores;  // indices into Topology::core_list()
  int numa_node = 0;       // NUMA node of its first core
  int sharing = 1;         // devices placed on these same cores (1 = it has them alone)
};

// Throws std::invalid_argument naming the count and the fix if devices < 1.
std::vector<DevicePlacement> layout_devices(const Topology& topology, int devices);

// A table "device -> cores (NUMA node)", one line per device.
std::string describe_layout(const Topology& topology, const std::vector<DevicePlacement>& layout);

}  // namespace weave::devices
