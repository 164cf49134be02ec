// A simulated device: a oneTBB arena whose worker threads are pinned to the device's cores,
// and an allocator bound to its NUMA node and counted by the memory tracker.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>

#include <tbb/task_arena.h>

#include "weave/devices/device_layout.hpp"
#include "weave/runtime/memory_tracker.hpp"

namespace weave::devices {

class Device {
 public:
  // Builds the arena (concurrency = number of its cores; 1 when it shares a core). pin=false
  // leaves the threads where the OS puts them.
  Device(const Topology& topology, DevicePlacement placement, rt::MemoryTracker& memory, bool pin);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  rt::DeviceId id() const { return placement_.device; }
  const DevicePlacement& placement() const { return placement_; }
  int numa_node() const { return placement_.numa_node; }
  tbb::task_arena& arena() { return arena_; }
  int concurrency() const;

  // 64-byte aligned memory on the device's NUMA node (when the host has more than one),
  // counted under `category`. Throws std::bad_alloc with the size and device on failure.
  void* allocate(std::size_t bytes, rt::MemoryCategory category);
  // Returns memory from allocate(); bytes and category must be those it was allocated with.
  void deallocate(void* pointer, std::size_t bytes, rt::MemoryCategory category);
  // Memory the device would hold, counted by the tracker as if allocated but not allocated:
  // what a step built without tensors (for a prediction) would need.
  void reserve(std::size_t bytes, rt::MemoryCategory category);
  void unreserve(std::size_t bytes, rt::MemoryCategory category);
  // Bytes allocate() handed out and deallocate() has not taken back (reservations excluded).
  std::int64_t allocated_bytes() const { return allocated_.load(std::memory_order_relaxed); }

 private:
  struct Pinning;
  const Topology& topology_;
  DevicePlacement placement_;
  rt::MemoryTracker& memory_;
  tbb::task_arena arena_;
  std::unique_ptr<Pinning> pinning_;
  std::atomic<std::int64_t> allocated_{0};
};

}  // namespace weave::devices
