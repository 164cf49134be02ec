// The pipeline schedule a training step ran, read back from its replay: per pipeline stage, the
// step's compute tasks grouped into one box per micro-batch, model chunk and phase, placed at the
// replayed times and drawn as `weave schedule --svg` draws a schedule's dry run.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "weave/graphs/pipeline_schedule.hpp"
#include "weave/graphs/pipeline_schedule_simulation.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::graphs {

struct ReplayedPipeline {
  std::string name;                               // the schedule's, for the title
  std::vector<rt::DeviceId> stage_devices;        // the device of pipeline rank r, r = 0 .. p-1
  int chunks = 1;                                 // model chunks a rank holds
  StageLayout layout = StageLayout::Interleaved;  // how the chunks are laid over the ranks
  // Zero-bubble schedules run the weight gradients as actions of their own (W); the others run
  // them within the backward, drawn as one box with it.
  bool split_backward = false;
};

// The actions each stage ran, in the order it started them (a task's virtual stage is the global
// stage its chunk is, read back into the rank's chunk), and their times: ms on the replay's
// clock from the earliest start. A box spans its first task's start to its last task's end (what
// ran in between, a transfer waited for, is inside it). Throws std::invalid_argument when a stage
// device ran no task of any micro-batch.
std::pair<PipelineSchedule, ScheduleReport> replayed_schedule(const rt::Trace& trace,
                                                              const ReplayedPipeline& pipeline);

// render_schedule_svg of replayed_schedule, the time axis in ms on the virtual clock.
std::string render_replayed_pipeline_svg(const rt::Trace& trace, const ReplayedPipeline& pipeline);

}  // namespace weave::graphs
