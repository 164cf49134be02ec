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
  // The devices this process holds, by id in [0, count) (empty: all of them). A run spread
  // over processes gives each process its own devices under their global ids, so that a
  // graph's device ids mean the same in every process; the graph of a process holds tasks on
  // its own devices only (the others stand in with an idle arena of one slot).
  std::vector<rt::DeviceId> held;
  // The cores the held devices are laid out on, as indices into the topology's core list
  // (empty: every core): a process of a multi-process run uses its own cores only.
  std::vector<int> cores;
};

class DeviceSet {
 public:
  // Lays `count` devices (or the options' held ones) out on the detected host. Throws
  // std::invalid_argument if count < 1 or a held id is outside [0, count) or repeated.
  explicit DeviceSet(int count, DeviceSetOptions options = {});
  DeviceSet(Topology topology, int count, DeviceSetOptions options = {});
  ~DeviceSet();

  // The devices' ids are [0, size()), held here or not.
  std::size_t size() const { return devices_.size(); }
  // Whether this process holds device `id` (every device unless DeviceSetOptions::held).
  bool holds(rt::DeviceId id) const { return id < devices_.size() && devices_[id] != nullptr; }
  // Throws std::out_of_range for a device outside the set or not held here.
  Device& operator[](rt::DeviceId id);
  const Topology& topology() const { return topology_; }
  // Where the held devices are, in id order (DevicePlacement::device is the id).
  const std::vector<DevicePlacement>& layout() const { return layout_; }
  rt::MemoryTracker& memory() { return memory_; }
  rt::Executor& executor() { return *executor_; }
  std::vector<tbb::task_arena*> arenas();

 private:
  Topology topology_;
  std::vector<DevicePlacement> layout_;
  rt::MemoryTracker memory_;
  std::vector<std::unique_ptr<Device>> devices_;  // by id; null where not held
  // The executor wants an arena per device id: those not held get an idle one.
  std::vector<std::unique_ptr<tbb::task_arena>> absent_;
  std::unique_ptr<rt::Executor> executor_;
  std::unique_ptr<tbb::global_control> workers_;  // enough TBB workers for every device slot
};

}  // namespace weave::devices
