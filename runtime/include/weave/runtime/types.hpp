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

// What a stream is for, as the layer that names the stream classifies it (a training step: the
// process group whose collectives run on it), so that reports group streams by that value and
// never by parsing their names. The runtime carries it and gives it no meaning; 0 is unclassified.
using StreamKind = std::uint8_t;
inline constexpr StreamKind kUnclassifiedStream = 0;

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

// The data movement of a collective member, named by what a cost model needs to price it: a
// group's algorithm moves a pattern's payload. What each pattern's payload is, and the ring factor
// that turns it into CostHint::bytes, are stated beside the pattern's algorithms by the layer that
// prices them (weave::devices' transfer patterns); the runtime only carries the pattern.
enum class TransferPattern : std::uint8_t {
  none,
  all_reduce,
  all_gather,
  reduce_scatter,
  all_to_all,
  broadcast,
  point_to_point,
  barrier
};

// What a task costs, for the virtual clock and the link model. bytes is the volume that
// crosses a link per member (for a collective, already scaled by its algorithm's factor), or the
// memory a compute task streams; messages is the number of latency terms (alpha) the task pays:
// a transfer's messages, or the kernels a compute task stands for, each paying a launch.
//
// The kernel shapes let a machine model price kinds of work apart (see devices::KernelRates):
// attention_flops is the part of `flops` in attention kernels, and matmul_edges sums over the
// task's matrix products 2 (mn + nk + mk) for an [m, k] x [k, n] product, the term a product's
// overhead grows with when a dimension is small. Floats: they price, they never count.
struct CostHint {
  double flops = 0;
  double bytes = 0;
  std::uint32_t messages = 0;
  float attention_flops = 0;
  float matmul_edges = 0;

  // What a collective member takes part in, for a cost model that prices the group's algorithm
  // for where the group sits in a cluster (which links it spans) rather than as the ring over
  // one link that bytes and messages describe. Left at their defaults by every other task.
  // The payload the pattern moves is bytes read back through the pattern's ring factor. The
  // group's devices are group_first_device + i * group_device_stride,
  // i in [0, group_size) (stride 0: not evenly spaced, so a cost model reads the members it
  // has): given here because a replay that builds only some ranks (data-parallel folding)
  // holds only some members' tasks.
  std::uint32_t group_size = 0;
  std::uint32_t group_first_device = 0;
  std::uint32_t group_device_stride = 0;
  TransferPattern pattern = TransferPattern::none;
};

// Costs of work run one after another in one task: summed; scaled for a share of it (messages
// are summed, and kept when scaled: a share of a transfer still pays its latencies).
constexpr CostHint operator+(CostHint a, const CostHint& b) {
  a.flops += b.flops;
  a.bytes += b.bytes;
  a.messages += b.messages;
  a.attention_flops += b.attention_flops;
  a.matmul_edges += b.matmul_edges;
  return a;
}
constexpr CostHint operator*(double share, CostHint a) {
  a.flops *= share;
  a.bytes *= share;
  a.attention_flops = static_cast<float>(a.attention_flops * share);
  a.matmul_edges = static_cast<float>(a.matmul_edges * share);
  return a;
}
constexpr CostHint operator*(CostHint a, double share) {
  return share * a;
}
constexpr CostHint operator/(CostHint a, double parts) {
  a.flops /= parts;
  a.bytes /= parts;
  a.attention_flops = static_cast<float>(a.attention_flops / parts);
  a.matmul_edges = static_cast<float>(a.matmul_edges / parts);
  return a;
}

std::string_view to_string(TaskKind kind);
// "F", "B", "W" or "" for Phase::none.
std::string_view to_string(Phase phase);

}  // namespace weave::rt
