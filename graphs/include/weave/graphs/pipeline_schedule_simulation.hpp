// Checks a pipeline schedule and dry-runs it in a simple time model.
//
// The check: every (stage, micro-batch) has exactly one forward and either one full backward or
// one input-gradient and one weight-gradient action, and on its rank the forward comes before
// the backward and the input gradient before the weight gradient. (The schedule's layout puts
// each stage on one rank by construction.)
//
// The dry run: each rank runs its list in order, one action at a time; an action starts when the
// rank is free and its inputs are ready, otherwise the rank waits. A forward needs the previous
// stage's forward, a full or input-gradient backward the next stage's, a weight gradient its
// own input gradient. Sends and receives are free and asynchronous. If no rank can move while
// work remains, the schedule deadlocks and the report says who waits for what.
#pragma once

#include <string>
#include <vector>

#include "weave/graphs/pipeline_schedule.hpp"

namespace weave::graphs {

// Durations of one action on one chunk. The defaults are the unit model of the reference
// orders: a backward costs two forwards, split evenly into its input and weight halves. An idle
// slot lasts one forward.
struct TimeModel {
  double forward = 1;
  double backward = 2;
  double backward_input = 1;
  double backward_weight = 1;

  double duration(ActionType type) const;
};

struct TimedAction {
  Action action;
  int step = 0;  // position in the rank's list
  double start = 0;
  double end = 0;
};

struct RankReport {
  double busy = 0;  // time spent computing
  double idle = 0;  // makespan - busy
  // Activations held at the peak, in units of a micro-batch's activations on the rank (a chunk
  // holds 1/v). A chunk's activations live from its forward to its full backward, or to its
  // weight gradient when the backward is split.
  double peak_activations = 0;
  int peak_step = -1;  // the step (list position) at which the peak is first reached
};

struct ScheduleReport {
  // Every rule the schedule breaks, and a deadlock if there is one; empty when it is valid.
  std::vector<std::string> problems;
  bool simulated = false;  // false when the checks failed or the run deadlocked
  std::vector<std::vector<TimedAction>> timeline;  // per rank, in list order (when simulated)
  std::vector<RankReport> ranks;
  double makespan = 0;
  // Idle time over all ranks divided by the busy time (the bubble as a share of the ideal time,
  // as the literature's formulas give it) and by the total time p * makespan.
  double bubble_over_ideal = 0;
  double idle_over_total = 0;

  bool valid() const { return problems.empty(); }
};

ScheduleReport simulate_schedule(const PipelineSchedule& schedule, const TimeModel& time = {});

}  // namespace weave::graphs
