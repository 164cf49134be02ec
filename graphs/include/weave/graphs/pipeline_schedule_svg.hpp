// A picture of a pipeline schedule: an SVG device x time grid.
#pragma once

#include <string>

#include "weave/graphs/pipeline_schedule.hpp"
#include "weave/graphs/pipeline_schedule_simulation.hpp"

namespace weave::graphs {

// One row per rank (rank 0 on top), time to the right, one rectangle (class "action") per
// compute action, placed and sized by the simulated start and end times; blank space is the
// bubble. Colour says the phase (forward, full backward, input gradient, weight gradient) and
// every box carries its micro-batch's number (class "micro-batch"), across the box when it fits
// and upright when the box is narrow, so that p=8, m=32 reads at 1600 px; a tooltip names every
// cell. Chunks after a rank's first are hatched and their numbers primed (3'). The title gives
// the schedule and its simulated bubble. A schedule the simulation refused is drawn step by step
// instead, with the first problem under the title.
//
// A timeline that is not in the dry run's units (a replayed step's, in ms) names its unit in
// `time_axis` and, with `fill_width`, is stretched over a plot that makes the SVG 1600 px wide
// instead of 26 px per unit (1,800 px of plot at most).
struct ScheduleSvgOptions {
  std::string time_axis;  // the axis's caption; empty: the dry run's units
  bool fill_width = false;
};
std::string render_schedule_svg(const PipelineSchedule& schedule, const ScheduleReport& report,
                                const ScheduleSvgOptions& options = {});

}  // namespace weave::graphs
