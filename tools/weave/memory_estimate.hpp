// What a training run will hold in memory, known before any tensor is allocated: the step is
// built with shapes only (StepBuildOptions::materialize = false) and each device's memory
// tracker counts what it would hold. A run that cannot fit the host is refused with the figures
// instead of dying in the allocator part-way through.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "weave/graphs/trainer_config.hpp"
#include "weave/runtime/memory_tracker.hpp"

namespace weave::cli {

struct MemoryEstimate {
  // Per device, the bytes of each rt::MemoryCategory, and the most it holds at once.
  std::vector<std::array<std::int64_t, rt::kMemoryCategoryCount>> by_category;
  std::vector<std::int64_t> peak;

  std::int64_t total() const;          // summed over the devices, which share the host
  std::size_t largest_device() const;  // the device of the highest peak
  // "12.3 MiB per device at most (parameters 1.2 MiB, ...); 4 devices: 49.2 MiB".
  std::string describe() const;
};

// Builds `config`'s step without tensors (config must have passed graphs::validate) on devices
// of its own and reads their trackers.
MemoryEstimate estimate_memory(const graphs::TrainerConfig& config);

// The memory this process may use: the host's physical memory, or less under a cgroup limit.
std::int64_t host_memory_bytes();

// Throws graphs::ConfigError with the estimate, the host's memory and what to lower when the
// run needs more than `host` bytes.
void check_fits(const MemoryEstimate& estimate, std::int64_t host);

// Bytes as "512 B", "12.3 MiB", "4.00 GiB".
std::string bytes_text(std::int64_t bytes);

}  // namespace weave::cli
