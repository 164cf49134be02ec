#include "weave/runtime/memory_tracker.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace weave::rt {

std::string_view to_string(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::parameters:
      return "parameters";
    case MemoryCategory::gradients:
      return "gradients";
    case MemoryCategory::optimizer_state:
      return "optimizer_state";
    case MemoryCategory::activations:
      return "activations";
    case MemoryCategory::comm_buffers:
      return "comm_buffers";
    case MemoryCategory::workspace:
      return "workspace";
  }
  return "?";
}

namespace {
void raise_peak(std::atomic<std::int64_t>& peak, std::int64_t value) {
  std::int64_t p = peak.load(std::memory_order_relaxed);
  while (value > p && !peak.compare_exchange_weak(p, value, std::memory_order_relaxed)) {
  }
}
}  // namespace

MemoryTracker::MemoryTracker(std::size_t devices)
    : devices_(devices), counters_(std::make_unique<Counters[]>(devices)) {}

const MemoryTracker::Counters& MemoryTracker::at(DeviceId device) const {
  if (device >= devices_) {
    throw std::out_of_range(
        fmt::format("memory tracker: device {} does not exist ({} devices)", device, devices_));
  }
  return counters_[device];
}

void MemoryTracker::allocated(DeviceId device, MemoryCategory category, std::int64_t bytes) {
  auto& c = const_cast<Counters&>(at(device));
  const auto i = static_cast<std::size_t>(category);
  raise_peak(c.peak[i], c.current[i].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  raise_peak(c.total_peak, c.total.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  if (observer_) observer_(device, category, bytes);
}

void MemoryTracker::released(DeviceId device, MemoryCategory category, std::int64_t bytes) {
  auto& c = const_cast<Counters&>(at(device));
  const auto i = static_cast<std::size_t>(category);
  const std::int64_t left = c.current[i].fetch_sub(bytes, std::memory_order_relaxed) - bytes;
  c.total.fetch_sub(bytes, std::memory_order_relaxed);
  if (left < 0) {
    c.current[i].fetch_add(bytes, std::memory_order_relaxed);  // refuse it, change nothing
    c.total.fetch_add(bytes, std::memory_order_relaxed);
    throw std::logic_error(fmt::format(
        "memory tracker: device {} released {} more bytes of {} than it holds (a double free "
        "or a release in the wrong category)",
        device, -left, to_string(category)));
  }
  if (observer_) observer_(device, category, -bytes);
}

std::int64_t MemoryTracker::current(DeviceId device, MemoryCategory category) const {
  return at(device).current[static_cast<std::size_t>(category)].load(std::memory_order_relaxed);
}
std::int64_t MemoryTracker::peak(DeviceId device, MemoryCategory category) const {
  return at(device).peak[static_cast<std::size_t>(category)].load(std::memory_order_relaxed);
}
std::int64_t MemoryTracker::current_total(DeviceId device) const {
  return at(device).total.load(std::memory_order_relaxed);
}
std::int64_t MemoryTracker::peak_total(DeviceId device) const {
  return at(device).total_peak.load(std::memory_order_relaxed);
}

void MemoryTracker::reset_peaks() {
  for (std::size_t d = 0; d < devices_; ++d) {
    Counters& c = counters_[d];
    for (std::size_t i = 0; i < kMemoryCategoryCount; ++i) {
      c.peak[i].store(c.current[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
    }
    c.total_peak.store(c.total.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
}

}  // namespace weave::rt
