// Synthetic task graphs that exercise the runtime without a model: a pipelined
// compute/all-to-all pattern (the overlap Ampipe exploits) and the classic graph shapes.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/runtime/graph.hpp"

namespace weave::cli {

struct WorkloadOptions {
  // overlap: per layer, `chunks` compute tasks on every device, each followed by an all-to-all
  //          over all devices on the comm stream, so chunk c's exchange can hide behind chunk
  //          c+1's compute; a combine task closes the layer.
  // chain | fanout | wavefront: the runtime benchmark shapes, spread over the devices.
  std::string shape = "overlap";
  int devices = 8;
  int layers = 2;
  int chunks = 4;
  double flops_per_task = 2e7;  // cost hint and, with real work, the arithmetic actually done
  double bytes_per_exchange = 4 << 20;  // per device, per all-to-all
  int size = 64;                        // tasks in a chain / fan-out, side of a wavefront
};

// The graph and the buffers its tasks touch (kept alive as long as the graph runs).
struct Workload {
  rt::Graph graph;
  std::shared_ptr<void> buffers;
};

// With `devices`, tasks do real work in buffers from the devices' allocators; without, the
// tasks are empty (for the virtual clock at any scale). Throws std::invalid_argument naming a
// bad option and its valid range.
Workload build_workload(const WorkloadOptions& options, devices::DeviceSet* devices);

std::vector<std::string> workload_shapes();

}  // namespace weave::cli
