// Figures derived from a trace: how busy each device and stream was and how much
// communication was exposed (running while the device computed nothing).
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "weave/runtime/trace.hpp"
#include "weave/runtime/types.hpp"

namespace weave::rt {

struct DeviceMetrics {
  std::vector<Nanos> stream_busy;  // indexed by StreamId
  Nanos compute_busy = 0;          // union of compute tasks' spans
  Nanos comm_busy = 0;             // union of comm and copy tasks' spans
  Nanos exposed_comm = 0;          // comm_busy minus its overlap with compute_busy
  Nanos busy = 0;                  // union of every span on the device
  double idle_fraction = 0;        // 1 - busy / makespan
};

struct TraceMetrics {
  Nanos start = 0;     // earliest span start
  Nanos makespan = 0;  // latest end minus earliest start
  std::vector<DeviceMetrics> devices;
  Nanos total_compute() const;
  Nanos total_comm() const;
  Nanos total_exposed_comm() const;
  // Exposed communication over the sum of device busy time: the share of the step that
  // waits on data movement.
  double exposed_comm_share() const;
  // Compute idle time (makespan minus compute busy), summed over the devices with a task in the
  // trace (a device built elsewhere or folded has none).
  Nanos total_compute_idle() const;
  // total_compute_idle() over total_compute(): a pipeline's bubble as the schedules' formulas
  // define it ((p - 1) / m for 1F1B).
  double compute_bubble() const;
};

TraceMetrics measure(const Trace& trace);

// The exposed time, summed over devices, of the comm and copy tasks whose names contain one of
// `name_parts` (say "dispatch" and "combine" for MoE all-to-alls): their union on each device
// minus its overlap with the device's compute.
Nanos exposed_comm_named(const Trace& trace, std::span<const std::string_view> name_parts);
// The same for the comm and copy tasks on streams of one of `kinds` (StreamKind: the streams of
// one process group, as the layer that made them classified them).
Nanos exposed_comm_on_stream_kinds(const Trace& trace, std::span<const StreamKind> kinds);
// The same for the comm and copy tasks on the streams `streams`.
Nanos exposed_comm_on_stream_ids(const Trace& trace, std::span<const StreamId> streams);
// exposed_comm_on_stream_ids of each set of streams, from one pass over the trace (the compute
// intervals sorted once for every set).
std::vector<Nanos> exposed_comm_on_stream_sets(const Trace& trace,
                                               std::span<const std::vector<StreamId>> sets);

// The same, the streams chosen by their names, for a trace whose streams carry no kind: one read
// back from a file (read_chrome_trace) or written by another program. A trace weave runs or
// replays chooses its streams by kind or id above.
// Streams whose names start with one of `prefixes` ("tp" gives tp, tp_grad and tp_cp).
Nanos exposed_comm_on_streams(const Trace& trace, std::span<const std::string_view> prefixes);
// Streams named exactly `names` ("tp" alone, not "tp_cp").
Nanos exposed_comm_on_named_streams(const Trace& trace, std::span<const std::string_view> names);

}  // namespace weave::rt
