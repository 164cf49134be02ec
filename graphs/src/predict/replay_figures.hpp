// What a prediction reads from one replay, kept as the integers the virtual clock and the memory
// trackers give (nanoseconds, bytes), so that replays of a step with other micro-batch counts can
// be compared and extrapolated exactly (micro_batch_fold.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "weave/graphs/memory_timeline.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/memory_tracker.hpp"
#include "weave/runtime/trace.hpp"
#include "weave/runtime/types.hpp"

namespace weave::graphs {

struct ReplayFigures {
  rt::Nanos makespan = 0;
  // Summed over the devices with any task: compute busy, and compute idle (makespan - busy).
  rt::Nanos compute_busy = 0, compute_idle = 0;
  rt::Nanos exposed_total = 0;  // every group's together, summed over devices
  // Compute busy by kind of work (ComputeKind), summed over devices: each compute task's span
  // split by the shares its cost's parts take on the modelled device.
  std::array<rt::Nanos, kComputeKindCount> compute_by_kind{};
  std::vector<std::string> groups;  // the process groups with communication streams
  std::vector<rt::Nanos> exposed;   // per group, summed over devices
  std::vector<std::array<std::int64_t, rt::kMemoryCategoryCount>> memory;  // per device
  std::vector<std::int64_t> memory_total;                                  // per device
  int replayed_devices = 0;
  std::int64_t tasks_built = 0;    // the graph's (a fold's: its largest replay's)
  std::vector<int> micro_batches;  // set by a fold: the counts it extrapolated from
  rt::Trace trace;
  MemoryTimeline memory_over_step;  // per device (a folded one: its source's); empty when folded
  rt::Graph graph;                  // the graph replayed
  rt::Trace what_if_trace;          // the graph replayed with PredictionOptions::what_if's costs
};

// The figures of a step with `steps` more periods than `first`, when `first`, `second` and `third`
// are replays of the same step `period` micro-batches apart and every figure grows by the same
// amount from `first` to `second` as from `second` to `third` (the pipeline's steady phase
// repeats); std::nullopt otherwise. The trace and graph are left empty.
std::optional<ReplayFigures> extrapolate(const ReplayFigures& first, const ReplayFigures& second,
                                         const ReplayFigures& third, std::int64_t steps);

}  // namespace weave::graphs
