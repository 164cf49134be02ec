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
  executor_ = std::make_unique<rt::Executor>(arenas());
}

DeviceSet::~DeviceSet() {
  executor_.reset();  // it runs on the devices' arenas
  devices_.clear();
}

std::vector<tbb::task_arena*> DeviceSet::arenas() {
  std::vector<tbb::task_arena*> a;
  for (auto& d : devices_)
    a.push_back(&d->arena());
  return a;
}

}  // namespace weave::devices
