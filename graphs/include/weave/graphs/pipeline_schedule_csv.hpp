// Pipeline schedules as CSV, one row per rank, in PyTorch's stage-prefixed text form.
//
//   # comment lines start with '#'
//   0F0,0F1,0F2,0F3,0B0,0F4,...      <- rank 0
//   1F0,1F1,1F2,1B0,...              <- rank 1
//
// A cell is STAGE TYPE MICRO_BATCH: "2F0" is stage 2's forward of micro-batch 0. TYPE is F
// (forward), B (full backward), I (input gradient) or W (weight gradient). The stage may be left
// out to mean the rank's first stage ("F0" on row 1 is "1F0"). Whitespace around and inside a
// cell is ignored; an empty cell is a deliberate idle slot, except at the end of a row, where it
// would change nothing. Blank lines are skipped: a rank with nothing to do is a lone comma.
// Communication cells of PyTorch's compute-and-communication form
// (SEND_F, RECV_F, SEND_B, RECV_B) are accepted and skipped: weave derives them from the
// layout.
//
// The ranks are the rows; the chunks per rank follow from the highest stage; the layout
// (interleaved, or the V of zb-v) from which stages each row holds.
#pragma once

#include <string>
#include <string_view>

#include "weave/graphs/pipeline_schedule.hpp"

namespace weave::graphs {

std::string write_schedule_csv(const PipelineSchedule& schedule);

// Reads a schedule; micro_batches = 0 takes the highest micro-batch named plus one. Throws
// ScheduleError naming the line, the cell and what was expected. The result is not checked:
// simulate_schedule reports missing, duplicated and out-of-order actions.
PipelineSchedule read_schedule_csv(std::string_view text, std::string name = "csv",
                                   int micro_batches = 0);

}  // namespace weave::graphs
