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
// The same over some of the host's cores only (indices into Topology::core_list(), in order):
// a process of a multi-process run lays its devices out on its own cores. Throws
// std::invalid_argument for an empty or out-of-range core list.
std::vector<DevicePlacement> layout_devices(const Topology& topology, int devices,
                                            const std::vector<int>& cores);

// The cores (indices into Topology::core_list()) process `index` of the `count` processes of a
// multi-process run that share this host lays its devices on: the cores it is bound to (mpirun
// binds each process to cores of its own when there are enough), or, when it is free to run on
// the whole host, block `index` of `count` equal blocks (processes share cores when they
// outnumber them).
std::vector<int> process_cores(const Topology& topology, int index, int count);

// A table "device -> cores (NUMA node)", one line per device.
std::string describe_layout(const Topology& topology, const std::vector<DevicePlacement>& layout);

}  // namespace weave::devices
