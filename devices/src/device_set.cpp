#include "weave/devices/device_set.hpp"

namespace weave::devices {

DeviceSet::DeviceSet(int count, DeviceSetOptions options)
    : DeviceSet(Topology::detect(), count, options) {}

DeviceSet::DeviceSet(Topology topology, int count, DeviceSetOptions options)
    : topology_(std::move(topology)),
      layout_(layout_devices(topology_, count)),
      memory_(static_cast<std::size_t>(count)) {
  for (const DevicePlacement& p : layout_) {
    devices_.push_back(std::make_unique<Device>(topology_, p, memory_, options.pin));
  }
  // TBB starts one worker fewer than the host has cores, counting on the main thread to work
  // too; but the main thread only waits for the graph here. Without a worker for every slot of
  // every arena, a kernel's parallel_for inside a device would find no second thread.
  int slots = 0;
  for (const auto& d : devices_)
    slots += d->concurrency();
  if (static_cast<std::size_t>(slots + 1) >
      tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism))
    workers_ = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                     static_cast<std::size_t>(slots + 1));
  executor_ = std::make_unique<rt::Executor>(arenas());
}

DeviceSet::~DeviceSet() {
  executor_.reset();  // it runs on the devices' arenas
  devices_.clear();
  workers_.reset();
}

std::vector<tbb::task_arena*> DeviceSet::arenas() {
  std::vector<tbb::task_arena*> a;
  for (auto& d : devices_)
    a.push_back(&d->arena());
  return a;
}

}  // namespace weave::devices
