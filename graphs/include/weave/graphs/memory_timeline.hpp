// Each device's memory over one step, by category: the allocations and releases a step's build
// made (TrainingStep::memory_events), each placed on a replay of the step's graph at the start of
// the first task built after it (for an activation set, the first task built using the set): the
// first task that can hold the buffer.
//
// A step built without tensors reserves its buffers when it is built and holds them until it is
// destroyed, as a caching allocator keeps what it was given: activation sets are laid out once and
// reused by later micro-batches. So a device's bytes rise as its step first reaches each buffer
// and its peak is the one the device's memory tracker counted (the figure weave predict prints).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "weave/runtime/memory_tracker.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::graphs {

// One allocation (bytes > 0) or release (bytes < 0) a step's build made, and the number of tasks
// built before it: the next task built is the first that can use the buffer (an activation
// set's: the number built before the first task using the set).
struct MemoryEvent {
  rt::DeviceId device = 0;
  rt::MemoryCategory category = rt::MemoryCategory::activations;
  std::int64_t bytes = 0;
  std::size_t tasks_built = 0;
};

// Every category's bytes held on a device from `at` on (ns on the replay's clock).
struct MemoryPoint {
  rt::Nanos at = 0;
  std::array<std::int64_t, rt::kMemoryCategoryCount> bytes{};
};

// The step's memory per device: a point per event, in time order (events at one time in the
// order they were made, so no transient is lost), starting from nothing at 0 and ending at the
// makespan.
struct MemoryTimeline {
  std::vector<std::vector<MemoryPoint>> devices;

  // The most a category held at once on a device, and the most all of them held together.
  std::int64_t peak(std::size_t device, rt::MemoryCategory category) const;
  std::int64_t peak_total(std::size_t device) const;
};

// The timeline of `events` on `trace`, a replay of the graph they were recorded building: an
// event placed at the start of task `tasks_built` (0 before any task; the makespan past the last
// one). `devices` devices; an event naming another throws std::invalid_argument.
MemoryTimeline memory_timeline(const std::vector<MemoryEvent>& events, const rt::Trace& trace,
                               std::size_t devices);

}  // namespace weave::graphs
