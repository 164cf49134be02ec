// A picture of a pipeline schedule: an SVG device x time grid.
#pragma once

#include <string>

#include "weave/graphs/pipeline_schedule.hpp"
#include "weave/graphs/pipeline_schedule_simulation.hpp"

namespace weave::graphs {

// One row per rank (rank 0 on top), time to the right, one rectangle (class "action") per
// compute action, placed and sized by the simulated start and end times; blank space is the
// bubble. Each micro-batch has its own hue: forwards light, full backwards dark, input gradients
// in between and weight gradients darkest, each labelled with its letter and micro-batch where
// the label fits (a tooltip names every cell). Chunks after a rank's first are hatched and their
// labels primed (F3'). The title gives the schedule and its simulated bubble. A schedule the
// simulation refused is drawn step by step instead, with the first problem under the title.
std::string render_schedule_svg(const PipelineSchedule& schedule, const ScheduleReport& report);

}  // namespace weave::graphs
