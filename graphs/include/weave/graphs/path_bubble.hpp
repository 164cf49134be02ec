// The pipeline's bubble on a training step's critical path: the time the device that ends the
// step stood idle waiting for another pipeline stage. A step of the path is on another stage when
// it is a pipeline transfer (a stage's send to the next or the previous) or runs on a device of
// another stage than the path's last task; the part of it during which the last task's device
// computed nothing is bubble (the warm-up before the first micro-batch reaches a stage, the
// cool-down after, the waits between), the rest, while that device computed off the path, stays
// the step's own kind.
#pragma once

#include <vector>

#include "weave/graphs/mesh.hpp"
#include "weave/runtime/critical_path.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::graphs {

// Per device of `mesh`: its pipeline stage.
std::vector<int> pipeline_stage_of_devices(const Mesh& mesh);

// Per step of `path` (of `trace`, a replay of the step's graph): its bubble time.
// `stage_of_device` per device (pipeline_stage_of_devices); a device past its end counts as
// stage 0.
std::vector<rt::Nanos> bubble_of_steps(const rt::CriticalPath& path, const rt::Trace& trace,
                                       const std::vector<int>& stage_of_device);
rt::Nanos pipeline_bubble(const rt::CriticalPath& path, const rt::Trace& trace,
                          const std::vector<int>& stage_of_device);

// rt::summarize with the bubble apart: "pipeline bubble" in by_kind, each step's other time its
// own kind's (by_wait unchanged). Largest first.
rt::CriticalPathSummary summarize_with_bubble(const rt::CriticalPath& path, const rt::Trace& trace,
                                              const std::vector<int>& stage_of_device);

}  // namespace weave::graphs
