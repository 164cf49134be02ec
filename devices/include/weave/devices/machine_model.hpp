// A cost model for a set of devices: compute at each device's modelled rate and memory
// bandwidth, transfers over the link model's class between the devices involved.
#pragma once

#include <optional>
#include <vector>

#include "weave/devices/cluster.hpp"
#include "weave/devices/kernel_rates.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/runtime/cost_model.hpp"

namespace weave::devices {

class MachineModel : public rt::CostModel {
 public:
  // numa_of_device[d] is device d's NUMA node; flops_per_second and memory_bytes_per_second
  // apply to every device (0 bytes per second: memory traffic is free).
  // With a cluster, collective members (a cost hint with a transfer pattern) are costed by the
  // algorithm their group would use on it, device ids read as global ranks (a DeviceSet keeps
  // global ids, held or not); other comm and copy tasks keep the link model.
  MachineModel(std::vector<int> numa_of_device, double flops_per_second, LinkModel links,
               double memory_bytes_per_second = 0, std::optional<Cluster> cluster = {});
  // Compute priced by kind instead (see KernelRates): products by their shapes, attention at its
  // own rate, streaming at the memory bandwidth, summed.
  MachineModel(std::vector<int> numa_of_device, KernelRates kernels, LinkModel links,
               std::optional<Cluster> cluster = {});

  // compute: with kernel rates, the sum of the task's kinds of work (KernelRates); without, the
  // longer of flops / rate and bytes / memory bandwidth (a roofline: a kernel is bound by its
  // arithmetic or by the memory it streams). comm and copy: the link model, over the
  // link class between the task's device and the other members of its rendezvous (the slowest class
  // present), or with a cluster Cluster::collective_duration for a collective member. host: 0.
  // Throws std::out_of_range for a task on a device the model does not know.
  using rt::CostModel::duration;
  rt::Nanos duration(const rt::TaskTable& tasks, rt::TaskId task,
                     const rt::CostHint& cost) const override;

  const LinkModel& links() const { return links_; }
  double flops_per_second() const { return flops_per_second_; }
  double memory_bytes_per_second() const { return memory_bytes_per_second_; }
  const std::optional<KernelRates>& kernels() const { return kernels_; }
  const std::optional<Cluster>& cluster() const { return cluster_; }

 private:
  rt::Nanos cluster_duration(const rt::TaskTable& tasks, rt::TaskId task,
                             const rt::CostHint& cost) const;

  std::vector<int> numa_of_device_;
  double flops_per_second_;
  LinkModel links_;
  double memory_bytes_per_second_ = 0;
  std::optional<KernelRates> kernels_;
  std::optional<Cluster> cluster_;
};

}  // namespace weave::devices
