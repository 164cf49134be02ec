#include "weave/devices/process_group.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <stdexcept>

namespace weave::devices {

ProcessGroup::ProcessGroup(std::string name, std::vector<rt::DeviceId> devices)
    : name_(std::move(name)), devices_(std::move(devices)) {
  if (devices_.empty())
    throw std::invalid_argument(fmt::format("process group '{}' has no devices", name_));
  for (std::size_t i = 0; i < devices_.size(); ++i)
    for (std::size_t j = i + 1; j < devices_.size(); ++j)
      if (devices_[i] == devices_[j])
        throw std::invalid_argument(fmt::format(
            "process group '{}' lists device {} twice (ranks {} and {}): each device may hold one "
            "rank of a group",
            name_, devices_[i], i, j));
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
