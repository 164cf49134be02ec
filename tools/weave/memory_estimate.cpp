#include "memory_estimate.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <numeric>

#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::cli {

std::int64_t MemoryEstimate::total() const {
  return std::accumulate(peak.begin(), peak.end(), std::int64_t{0});
}

std::size_t MemoryEstimate::largest_device() const {
  return static_cast<std::size_t>(std::max_element(peak.begin(), peak.end()) - peak.begin());
}

std::string MemoryEstimate::describe() const {
  if (peak.empty()) return "no devices";
  const std::size_t d = largest_device();
  std::string parts;
  for (std::size_t c = 0; c < rt::kMemoryCategoryCount; ++c) {
    if (by_category[d][c] == 0) continue;
    std::string name(rt::to_string(static_cast<rt::MemoryCategory>(c)));
    std::replace(name.begin(), name.end(), '_', ' ');
    parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", name, bytes_text(by_category[d][c]));
  }
  return fmt::format("{} per device at most ({}); {} device{}: {}", bytes_text(peak[d]), parts,
                     peak.size(), peak.size() == 1 ? "" : "s", bytes_text(total()));
}

MemoryEstimate estimate_memory(const graphs::TrainerConfig& config) {
  devices::DeviceSet set(config.plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const graphs::TrainingStep step(config.model, config.plan, config.step_optimizer(), set, comm,
                                  {.materialize = false});
  MemoryEstimate e;
  for (std::size_t d = 0; d < set.size(); ++d) {
    const auto id = static_cast<rt::DeviceId>(d);
    std::array<std::int64_t, rt::kMemoryCategoryCount> bytes{};
    for (std::size_t c = 0; c < rt::kMemoryCategoryCount; ++c)
      bytes[c] = set.memory().peak(id, static_cast<rt::MemoryCategory>(c));
    e.by_category.push_back(bytes);
    e.peak.push_back(set.memory().peak_total(id));
  }
  return e;
}

std::int64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  std::int64_t bytes = pages > 0 && page > 0 ? std::int64_t{pages} * page : 0;
  // A container's limit (cgroup v2), when there is one.
  std::ifstream limit("/sys/fs/cgroup/memory.max");
  std::int64_t cgroup = 0;
  if (limit >> cgroup && cgroup > 0) bytes = bytes > 0 ? std::min(bytes, cgroup) : cgroup;
  return bytes;
}

void check_fits(const MemoryEstimate& estimate, std::int64_t host) {
  if (host <= 0 || estimate.total() <= host) return;
  throw graphs::ConfigError(fmt::format(
      "the run needs about {} of memory, more than this host's {}: {}. Lower --hidden-size, "
      "--ffn-hidden-size, --num-layers, --seq-length or --micro-batch-size, or the number of "
      "data-parallel replicas (--devices)",
      bytes_text(estimate.total()), bytes_text(host), estimate.describe()));
}

std::string bytes_text(std::int64_t bytes) {
  const auto b = static_cast<double>(bytes);
  if (bytes < 1024) return fmt::format("{} B", bytes);
  if (b < 1024.0 * 1024) return fmt::format("{:.1f} KiB", b / 1024);
  if (b < 1024.0 * 1024 * 1024) return fmt::format("{:.1f} MiB", b / (1024 * 1024));
  return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
}

}  // namespace weave::cli
