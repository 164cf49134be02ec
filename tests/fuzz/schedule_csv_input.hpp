// What the schedule_csv fuzz target does with one input, shared with the regression tests: the
// pipeline schedule CSV read, written and read again (the same schedule must come back), and the
// schedule checked by its simulation. Throws ScheduleError naming the line and cell for text it
// refuses; aborts when the round trip changes the schedule.
#pragma once

#include <cstdlib>
#include <string_view>

#include "weave/graphs/pipeline_schedule_csv.hpp"
#include "weave/graphs/pipeline_schedule_simulation.hpp"

namespace weave::fuzz {

inline void read_check_and_rewrite_schedule(std::string_view text) {
  const graphs::PipelineSchedule schedule = graphs::read_schedule_csv(text, "fuzz");
  const graphs::PipelineSchedule again = graphs::read_schedule_csv(
      graphs::write_schedule_csv(schedule), "fuzz", schedule.micro_batches);
  if (schedule.ranks != again.ranks || schedule.micro_batches != again.micro_batches ||
      schedule.chunks != again.chunks || schedule.layout != again.layout ||
      schedule.actions != again.actions)
    std::abort();
  graphs::simulate_schedule(schedule);
}

}  // namespace weave::fuzz
