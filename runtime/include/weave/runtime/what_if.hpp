// What-if replays: the same graph on the virtual clock with some tasks' costs changed.
//
// A change names what it changes and how (several are joined by commas):
//   <stream>=free     the transfers on that stream (a process group's, e.g. ep, tp, dp_cp, as
//                     the trace names its streams) take no time at all
//   <stream>*<f>      they move f times the bytes (latency unchanged)
//   compute*<f>       compute tasks do f times the work (flops, bytes streamed, kernel shapes)
//   attention*<f>     the attention part of compute tasks' flops is f times what it was
// '×' may be written for '*'. Scaling changes apply to the cost hint a task gives the cost
// model, so a what-if replay equals replaying a graph built with those hints (and "free" one
// whose transfers have no bytes and no messages, under a model that prices only those).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "weave/runtime/cost_model.hpp"

namespace weave::rt {

struct CostChange {
  enum class Target : std::uint8_t { stream, compute, attention };
  Target target = Target::stream;
  std::string stream;  // Target::stream: the stream's name
  double factor = 1;   // 0 for "free"

  std::string describe() const;
};

// Parses "ep=free,attention*0.5"; throws std::invalid_argument naming the part that is wrong and
// the accepted forms.
std::vector<CostChange> parse_cost_changes(std::string_view spec);

// The cost `task` has under the changes.
CostHint changed_cost(const TaskTable& tasks, TaskId task, CostHint cost,
                      const std::vector<CostChange>& changes);

// A cost model that prices each task at its changed cost with another model.
class WhatIfCostModel : public CostModel {
 public:
  WhatIfCostModel(const CostModel& base, std::vector<CostChange> changes);
  using CostModel::duration;
  Nanos duration(const TaskTable& tasks, TaskId task, const CostHint& cost) const override;

 private:
  const CostModel& base_;
  std::vector<CostChange> changes_;
};

}  // namespace weave::rt
