// The pipeline schedules weave knows how to build: GPipe, 1F1B, Megatron's interleaved 1F1B,
// MindSpore's memory-optimised interleaving, and the zero-bubble ZB-H1 and ZB-V.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weave/graphs/pipeline_schedule.hpp"

namespace weave::graphs {

enum class ScheduleKind {
  GPipe,           // "gpipe": all forwards, then all backwards
  OneFOneB,        // "1f1b": PipeDream-Flush, Megatron's non-interleaved schedule
  Interleaved,     // "interleaved": Megatron's interleaved 1F1B over v chunks per rank
  InterleavedMem,  // "interleaved-mem": MindSpore's memory-optimised interleaving
  ZeroBubbleH1,    // "zb-h1": 1F1B with the backward split into I and W, W's deferred
  ZeroBubbleV,     // "zb-v": two chunks per rank in a V, split backward
};

// The command-line names, in the order of ScheduleKind.
const std::vector<std::string>& schedule_names();
std::string_view schedule_name(ScheduleKind kind);
// Throws ScheduleError naming the known schedules and the closest one to `name`.
ScheduleKind schedule_kind(std::string_view name);

struct ScheduleParams {
  int ranks = 1;          // p, --pipeline-model-parallel-size
  int micro_batches = 1;  // m, --num-micro-batches
  int chunks = 1;         // v, --virtual-pipeline-size
  // N, --microbatch-group-size-per-virtual-pipeline-stage (interleaved only); 0: p.
  int group_size = 0;
};

// Builds the schedule, refusing parameters it cannot run with a ScheduleError naming the rule.
PipelineSchedule make_schedule(ScheduleKind kind, const ScheduleParams& params);

// Megatron's interleaved step table: forward step k runs table[k] = (micro-batch, chunk);
// micro-batches go in groups of N, the last group taking the remainder, and a group runs all
// its micro-batches on chunk 0, then on chunk 1, and so on. Backward step k runs the same
// micro-batch on chunk v - 1 - chunk.
std::vector<std::pair<int, int>> interleaved_step_table(int micro_batches, int chunks,
                                                        int group_size);

// What the literature says a schedule should achieve, for comparison with the simulation.
struct ScheduleTheory {
  std::string bubble_formula;  // e.g. "(p-1)/m"
  double bubble_over_ideal = 0;
  // Peak activations held per rank, in units of one micro-batch's activations on a rank.
  std::vector<double> peak_activations;
  // Set when the parameters lie outside the range the formulas hold for.
  std::string caveat;
};

// The time model's unit durations enter the zero-bubble formulas: t_F, t_I and t_W per chunk.
ScheduleTheory schedule_theory(ScheduleKind kind, const ScheduleParams& params,
                               double forward_time = 1, double backward_input_time = 1,
                               double backward_weight_time = 1);

}  // namespace weave::graphs
