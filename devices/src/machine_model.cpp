#include "weave/devices/machine_model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "transfer_algorithms.hpp"

namespace weave::devices {

MachineModel::MachineModel(std::vector<int> numa_of_device, double flops_per_second,
                           LinkModel links, double memory_bytes_per_second,
                           std::optional<Cluster> cluster)
    : numa_of_device_(std::move(numa_of_device)),
      flops_per_second_(flops_per_second),
      links_(std::move(links)),
      memory_bytes_per_second_(memory_bytes_per_second),
      cluster_(std::move(cluster)) {
  if (numa_of_device_.empty())
    throw std::invalid_argument("a machine model needs at least one device");
  if (!(flops_per_second > 0) || !std::isfinite(flops_per_second)) {
    throw std::invalid_argument(
        fmt::format("a device's modelled compute rate must be a positive FLOP/s figure (got {})",
                    flops_per_second));
  }
  if (!(memory_bytes_per_second >= 0) || !std::isfinite(memory_bytes_per_second))
    throw std::invalid_argument(fmt::format(
        "a device's modelled memory bandwidth must be a finite bytes/s figure >= 0 (got {})",
        memory_bytes_per_second));
}

void KernelRates::validate() const {
  auto rate = [](const char* what, double v, bool zero_allowed) {
    if (!std::isfinite(v) || v < 0 || (!zero_allowed && v == 0))
      throw std::invalid_argument(fmt::format("a device's {} must be a finite figure {} 0 (got {})",
                                              what, zero_allowed ? ">=" : ">", v));
  };
  rate("matrix-product rate (FLOP/s)", matmul_flops_per_second, false);
  rate("matrix-product overhead dimension (rows)", matmul_overhead_dimension, true);
  rate("attention rate (FLOP/s)", attention_flops_per_second, false);
  rate("attention backward rate (FLOP/s)", attention_backward_flops_per_second, true);
  rate("memory bandwidth (bytes/s)", memory_bytes_per_second, true);
  rate("per-kernel launch cost (s)", kernel_launch_seconds, true);
}

MachineModel::MachineModel(std::vector<int> numa_of_device, KernelRates kernels, LinkModel links,
                           std::optional<Cluster> cluster)
    : MachineModel(std::move(numa_of_device), kernels.matmul_flops_per_second, std::move(links),
                   kernels.memory_bytes_per_second, std::move(cluster)) {
  kernels.validate();
  kernels_ = kernels;
}

rt::Nanos MachineModel::cluster_duration(const rt::TaskTable& tasks, rt::TaskId task,
                                         const rt::CostHint& cost) const {
  const rt::CostHint& hint = tasks[task].cost;  // the build-time hint, which places the group
  const int n = static_cast<int>(hint.group_size);
  // The payload, read back from the ring's bytes (the hint's, or those a member reported at run
  // time for the variable collectives' real split) by the pattern's own ring factor.
  const double payload =
      n > 1 ? detail::transfer_algorithm(hint.pattern).payload_of_ring_bytes(n, cost.bytes)
            : cost.bytes;
  GroupPlacement group;
  if (hint.group_device_stride > 0 || n <= 1) {
    group = cluster_->place(hint.group_first_device, hint.group_device_stride, std::max(n, 1));
  } else {
    // Not evenly spaced: the members in the graph (all of them unless the step is folded).
    std::vector<std::uint32_t> ranks;
    if (tasks[task].group != rt::kNoGroup)
      for (rt::TaskId m : tasks.members(tasks[task].group))
        ranks.push_back(tasks[m].device);
    if (ranks.empty()) ranks.push_back(tasks[task].device);
    group = cluster_->place(std::move(ranks));
    group.size = n;
  }
  return cluster_->collective_duration(hint.pattern, payload, group);
}

rt::Nanos MachineModel::duration(const rt::TaskTable& tasks, rt::TaskId task,
                                 const rt::CostHint& cost) const {
  const rt::TaskInfo& t = tasks[task];
  auto numa = [&](rt::DeviceId d) {
    if (d >= numa_of_device_.size()) {
      throw std::out_of_range(
          fmt::format("task '{}' is on device {}, but the machine model knows {} device(s)",
                      tasks.name(task), d, numa_of_device_.size()));
    }
    return numa_of_device_[d];
  };
  switch (t.kind) {
    case rt::TaskKind::compute: {
      numa(t.device);
      if (kernels_) {
        const KernelRates& k = *kernels_;
        const double attention = cost.attention_flops;
        const double products =
            std::max(cost.flops - attention, 0.0) + k.matmul_overhead_dimension * cost.matmul_edges;
        const bool backward =
            t.tags.phase == rt::Phase::backward || t.tags.phase == rt::Phase::weight;
        const double attention_rate = backward && k.attention_backward_flops_per_second > 0
                                          ? k.attention_backward_flops_per_second
                                          : k.attention_flops_per_second;
        double seconds = products / k.matmul_flops_per_second + attention / attention_rate;
        if (k.memory_bytes_per_second > 0) seconds += cost.bytes / k.memory_bytes_per_second;
        seconds += k.kernel_launch_seconds * static_cast<double>(cost.messages);
        return static_cast<rt::Nanos>(std::llround(seconds * 1e9));
      }
      const double arithmetic = cost.flops / flops_per_second_;
      const double memory =
          memory_bytes_per_second_ > 0 ? cost.bytes / memory_bytes_per_second_ : 0.0;
      return static_cast<rt::Nanos>(std::llround(std::max(arithmetic, memory) * 1e9));
    }
    case rt::TaskKind::comm:
    case rt::TaskKind::copy: {
      const int here = numa(t.device);
      if (cluster_ && t.cost.pattern != rt::TransferPattern::none)
        return cluster_duration(tasks, task, cost);
      LinkClass link = links_.link_between(here, here);
      if (t.group != rt::kNoGroup) {
        for (rt::TaskId m : tasks.members(t.group)) {
          if (links_.link_between(here, numa(tasks[m].device)) == LinkClass::cross_numa) {
            link = LinkClass::cross_numa;  // the slowest link present sets the pace
          }
        }
      }
      return links_.duration(cost.bytes, cost.messages, link);
    }
    case rt::TaskKind::host:
      return 0;
  }
  return 0;
}

}  // namespace weave::devices
