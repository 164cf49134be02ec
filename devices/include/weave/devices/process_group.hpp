// A process group: the devices taking part in a collective, in rank order.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "weave/runtime/types.hpp"

namespace weave::devices {

class ProcessGroup {
 public:
  // Throws std::invalid_argument for an empty group or a device listed twice.
  ProcessGroup(std::string name, std::vector<rt::DeviceId> devices);

  const std::string& name() const { return name_; }
  int size() const { return static_cast<int>(devices_.size()); }
  rt::DeviceId device(int rank) const { return devices_.at(static_cast<std::size_t>(rank)); }
  std::span<const rt::DeviceId> devices() const { return devices_; }
  bool contains(rt::DeviceId device) const;
  // Throws std::invalid_argument naming the group and its devices if `device` is not a member.
  int rank_of(rt::DeviceId device) const;
  // The step between consecutive ranks' devices when they are evenly spaced (rank r on device
  // device(0) + r * stride, as every group of a parallel mesh is), else 0; 0 for one device.
  rt::DeviceId device_stride() const { return stride_; }

 private:
  std::string name_;
  std::vector<rt::DeviceId> devices_;
  rt::DeviceId stride_ = 0;
};

}  // namespace weave::devices
