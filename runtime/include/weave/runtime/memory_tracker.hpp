// Current and peak bytes per device and category, fed by the devices' allocators.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <utility>

#include "weave/runtime/types.hpp"

namespace weave::rt {

enum class MemoryCategory : std::uint8_t {
  parameters,
  gradients,
  optimizer_state,
  activations,
  comm_buffers,
  workspace,
};
inline constexpr std::size_t kMemoryCategoryCount = 6;
std::string_view to_string(MemoryCategory category);

// Thread-safe; lock-free on the allocation path.
class MemoryTracker {
 public:
  explicit MemoryTracker(std::size_t devices);

  std::size_t device_count() const { return devices_; }
  void allocated(DeviceId device, MemoryCategory category, std::int64_t bytes);
  // Throws std::logic_error if more is released than is held (a double free).
  void released(DeviceId device, MemoryCategory category, std::int64_t bytes);

  std::int64_t current(DeviceId device, MemoryCategory category) const;
  std::int64_t peak(DeviceId device, MemoryCategory category) const;
  std::int64_t current_total(DeviceId device) const;
  // Highest sum over categories held at one time on the device.
  std::int64_t peak_total(DeviceId device) const;
  // Peaks restart from the current values.
  void reset_peaks();

  // Called after every allocation (bytes > 0) and release (bytes < 0) is counted, on the thread
  // that made it: what a history of the memory over a step is read from. Set and clear it while
  // no other thread allocates (a step's build, not its run); empty by default, which costs the
  // allocation path one test.
  using Observer = std::function<void(DeviceId, MemoryCategory, std::int64_t bytes)>;
  void set_observer(Observer observer) { observer_ = std::move(observer); }

 private:
  struct alignas(64) Counters {
    std::array<std::atomic<std::int64_t>, kMemoryCategoryCount> current{};
    std::array<std::atomic<std::int64_t>, kMemoryCategoryCount> peak{};
    std::atomic<std::int64_t> total{0};
    std::atomic<std::int64_t> total_peak{0};
  };
  const Counters& at(DeviceId device) const;
  std::size_t devices_;
  std::unique_ptr<Counters[]> counters_;
  Observer observer_;
};

}  // namespace weave::rt
