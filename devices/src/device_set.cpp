#include "weave/devices/device_set.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <stdexcept>

namespace weave::devices {

namespace {

std::vector<rt::DeviceId> held_ids(int count, const std::vector<rt::DeviceId>& held) {
  if (count < 1)
    throw std::invalid_argument(
        fmt::format("the number of devices must be at least 1 (got {}); pass --devices N", count));
  if (held.empty()) {
    std::vector<rt::DeviceId> all(static_cast<std::size_t>(count));
    for (int d = 0; d < count; ++d)
      all[static_cast<std::size_t>(d)] = static_cast<rt::DeviceId>(d);
    return all;
  }
  std::vector<bool> seen(static_cast<std::size_t>(count), false);
  for (rt::DeviceId d : held) {
    if (d >= static_cast<rt::DeviceId>(count))
      throw std::invalid_argument(fmt::format(
          "DeviceSetOptions::held names device {}, outside the set's {} devices (0 to {})", d,
          count, count - 1));
    if (seen[d])
      throw std::invalid_argument(
          fmt::format("DeviceSetOptions::held names device {} twice; list each device once", d));
    seen[d] = true;
  }
  std::vector<rt::DeviceId> sorted = held;
  std::sort(sorted.begin(), sorted.end());
  return sorted;
}

std::vector<DevicePlacement> place(const Topology& topology, const std::vector<rt::DeviceId>& ids,
                                   const std::vector<int>& cores) {
  const int n = static_cast<int>(ids.size());
  std::vector<DevicePlacement> layout =
      cores.empty() ? layout_devices(topology, n) : layout_devices(topology, n, cores);
  for (std::size_t i = 0; i < layout.size(); ++i)
    layout[i].device = ids[i];
  return layout;
}

}  // namespace

DeviceSet::DeviceSet(int count, DeviceSetOptions options)
    : DeviceSet(Topology::detect(), count, std::move(options)) {}

DeviceSet::DeviceSet(Topology topology, int count, DeviceSetOptions options)
    : topology_(std::move(topology)),
      layout_(place(topology_, held_ids(count, options.held), options.cores)),
      memory_(static_cast<std::size_t>(count)) {
  // TBB starts one worker fewer than the process may use cores, counting on the main thread to
  // work too; but the main thread only waits for the graph here. Without a worker for every
  // slot of every arena, a kernel's parallel_for inside a device would find no second thread
  // (and a process bound to one core would get no worker at all). Raised before any arena
  // exists, so that TBB starts with the workers it needs.
  int slots = 0;
  for (const DevicePlacement& p : layout_)
    slots += p.sharing > 1 ? 1 : static_cast<int>(p.cores.size());
  if (static_cast<std::size_t>(slots + 1) >
      tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism))
    workers_ = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                     static_cast<std::size_t>(slots + 1));
  devices_.resize(static_cast<std::size_t>(count));
  for (const DevicePlacement& p : layout_)
    devices_[p.device] = std::make_unique<Device>(topology_, p, memory_, options.pin);
  // The devices not held share one idle arena: a prediction's thousands of folded devices
  // would each cost an arena's set-up and tear-down (most of the time of predicting Llama 3
  // 405B on 16,384 H100s).
  if (layout_.size() < devices_.size()) absent_.push_back(std::make_unique<tbb::task_arena>(1, 0));
  executor_ = std::make_unique<rt::Executor>(arenas());
}

DeviceSet::~DeviceSet() {
  executor_.reset();  // it runs on the devices' arenas
  devices_.clear();
  absent_.clear();
  workers_.reset();
}

Device& DeviceSet::operator[](rt::DeviceId id) {
  if (!holds(id)) {
    std::vector<rt::DeviceId> held;
    for (const DevicePlacement& p : layout_)
      held.push_back(p.device);
    throw std::out_of_range(
        id < devices_.size()
            ? fmt::format("device {} is not held by this process (it holds {}); a process "
                          "reaches other processes' devices through collectives only",
                          id, fmt::join(held, ", "))
            : fmt::format("device {} is outside the set of {} devices", id, devices_.size()));
  }
  return *devices_[id];
}

std::vector<tbb::task_arena*> DeviceSet::arenas() {
  std::vector<tbb::task_arena*> a;
  for (std::size_t d = 0; d < devices_.size(); ++d)
    a.push_back(devices_[d] ? &devices_[d]->arena() : absent_.front().get());
  return a;
}

}  // namespace weave::devices
