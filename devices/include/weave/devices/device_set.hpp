// The devices of one host, their memory tracker and the executor that runs graphs on them.
#pragma once

#include <tbb/global_control.h>

#include <memory>
#include <vector>

#include "weave/devices/device.hpp"
#include "weave/devices/topology.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/memory_tracker.hpp"

namespace weave::devices {

struct DeviceSetOptions {
  bool pin = true;  // pin each device's worker threads to its cores
};

class DeviceSet {
 public:
  // Lays `count` devices out on the detected host. Throws std::invalid_argument if count < 1.
  explicit DeviceSet(int count, DeviceSetOptions options = {});
  DeviceSet(Topology topology, int count, DeviceSetOptions options = {});
  ~DeviceSet();

  std::size_t size() const { return devices_.size(); }
  Device& operator[](rt::DeviceId id) { return *devices_.at(id); }
  const Topology& topology() const { return topology_; }
  const std::vector<DevicePlacement>& layout() const { return layout_; }
  rt::MemoryTracker& memory() { return memory_; }
  rt::Executor& executor() { return *executor_; }
  std::vector<tbb::task_arena*> arenas();

 private:
  Topology topology_;
  std::vector<DevicePlacement> layout_;
  rt::MemoryTracker memory_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::unique_ptr<rt::Executor> executor_;
  std::unique_ptr<tbb::global_control> workers_;  // enough TBB workers for every device slot
};

}  // namespace weave::devices
