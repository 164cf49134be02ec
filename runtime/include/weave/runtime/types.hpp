// Basic vocabulary of the runtime: identifiers, task kinds, tags and cost hints.
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>

namespace weave::rt {

using DeviceId = std::uint32_t;
using StreamId = std::uint16_t;
using TaskId = std::uint32_t;
using GroupId = std::uint32_t;
using EventId = std::uint32_t;

// Time in nanoseconds: wall-clock time since a run began, or virtual time.
using Nanos = std::int64_t;

inline constexpr TaskId kNoTask = std::numeric_limits<TaskId>::max();
inline constexpr GroupId kNoGroup = std::numeric_limits<GroupId>::max();

// Every device has these two streams; further streams are named on request.
inline constexpr StreamId kComputeStream = 0;
inline constexpr StreamId kCommStream = 1;

// What a task does, which decides how it is costed and drawn: compute runs kernels on the
// device's cores; comm and copy move data (and are held by a link model); host is bookkeeping.
enum class TaskKind : std::uint8_t { compute, comm, copy, host };

// Training phase of a task: forward, backward (input gradient) or weight gradient.
enum class Phase : std::uint8_t { none, forward, backward, weight };

// Where a task sits in a training step. -1 means "not applicable".
struct TaskTags {
  std::int32_t layer = -1;
  std::int32_t micro_batch = -1;
  std::int32_t virtual_stage = -1;
  std::int32_t chunk = -1;
  Phase phase = Phase::none;
};

// What a task costs, for the virtual clock and the link model. bytes is the volume that
// crosses a link per member (for a collective, already scaled by its algorithm's factor);
// messages is the number of latency terms (alpha) the transfer pays.
struct CostHint {
  double flops = 0;
  double bytes = 0;
  std::uint32_t messages = 0;
};

std::string_view to_string(TaskKind kind);
// "F", "B", "W" or "" for Phase::none.
std::string_view to_string(Phase phase);

}  // namespace weave::rt
