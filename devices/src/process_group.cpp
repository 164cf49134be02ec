#include "weave/devices/process_group.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace weave::devices {

ProcessGroup::ProcessGroup(std::string name, std::vector<rt::DeviceId> devices)
    : name_(std::move(name)), devices_(std::move(devices)) {
  if (devices_.empty())
    throw std::invalid_argument(fmt::format("process group '{}' has no devices", name_));
  // Sorted (device, rank) pairs: a device listed twice sits next to itself, found in n log n
  // for groups of thousands of devices.
  std::vector<std::pair<rt::DeviceId, std::size_t>> by_device(devices_.size());
  for (std::size_t i = 0; i < devices_.size(); ++i)
    by_device[i] = {devices_[i], i};
  std::sort(by_device.begin(), by_device.end());
  for (std::size_t k = 1; k < by_device.size(); ++k)
    if (by_device[k].first == by_device[k - 1].first)
      throw std::invalid_argument(fmt::format(
          "process group '{}' lists device {} twice (ranks {} and {}): each device may hold one "
          "rank of a group",
          name_, by_device[k].first, by_device[k - 1].second, by_device[k].second));
  if (devices_.size() > 1 && devices_[1] > devices_[0]) {
    stride_ = devices_[1] - devices_[0];
    for (std::size_t i = 2; i < devices_.size() && stride_ != 0; ++i)
      if (devices_[i] != devices_[0] + static_cast<rt::DeviceId>(i) * stride_) stride_ = 0;
  }
}

bool ProcessGroup::contains(rt::DeviceId device) const {
  return std::find(devices_.begin(), devices_.end(), device) != devices_.end();
}

int ProcessGroup::rank_of(rt::DeviceId device) const {
  const auto it = std::find(devices_.begin(), devices_.end(), device);
  if (it == devices_.end())
    throw std::invalid_argument(fmt::format("device {} is not in process group '{}' (devices {})",
                                            device, name_, fmt::join(devices_, ", ")));
  return static_cast<int>(it - devices_.begin());
}

}  // namespace weave::devices
