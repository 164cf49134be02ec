// A pipeline schedule lowered to a runtime task graph, and replayed on the virtual clock.
//
// Each rank is a device. Every compute action becomes one compute task on the rank's "compute"
// stream, in the rank's list order; every transfer that crosses ranks (lower_transfers, which
// places them) becomes a send on the producer's device ("p2p-send" stream) and a receive on the
// consumer's ("p2p-recv"), both comm tasks. The graph then shows the schedule's bubble and,
// through a MemoryTracker, its activation memory in the runtime's own terms. The training step
// runs the same lowered steps with a model's stages in the compute tasks.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "weave/graphs/pipeline_schedule.hpp"
#include "weave/graphs/pipeline_transfers.hpp"
#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/memory_tracker.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::graphs {

// Host work attached to one compute action: the action and the rank that runs it.
using PipelineActionWork = std::function<void(const Action&, int rank)>;

struct LoweringOptions {
  // FLOPs of one action on one chunk (the compute tasks' cost hints).
  double forward_flops = 0;
  double backward_flops = 0;         // full backward B
  double backward_input_flops = 0;   // I
  double backward_weight_flops = 0;  // W
  // Bytes a stage sends per micro-batch: its output forward, its input gradient backward.
  double transfer_bytes = 0;
  // Activations one chunk keeps for one micro-batch, from its forward until its full backward
  // (or its weight gradient when the backward is split) has run.
  std::int64_t chunk_activation_bytes = 0;
  // When set, each forward's work allocates the chunk's activations on the rank's device and
  // the matching B or W's work releases them, so the tracker's peaks are the schedule's.
  rt::MemoryTracker* memory = nullptr;
  // When set, runs inside every compute task's work (between the allocation and the release).
  PipelineActionWork work;
};

// One cross-rank dependency: the producer's send and the consumer's receive.
struct PipelineTransfer {
  rt::TaskId send = rt::kNoTask;
  rt::TaskId receive = rt::kNoTask;
  int from_rank = 0;
  int to_rank = 0;
};

struct LoweredSchedule {
  // Per rank, per position in the rank's action list: the compute task (kNoTask for an idle
  // slot, which adds no task: on the clock a rank waits only for its inputs).
  std::vector<std::vector<rt::TaskId>> tasks;
  std::vector<PipelineTransfer> transfers;
};

// Adds the schedule's tasks to `builder` (device = rank). Compute tasks are named like
// "r1.F3.c0" (rank, action, micro-batch, chunk) and tagged with the micro-batch, the global
// stage (virtual_stage), the chunk and the phase (B and I backward, W weight). Edges: F of
// stage s after F of s-1; B or I of s after B or I of s+1 and after F of s (the last stage
// after its own F only); W after its I; through a send and a receive when the two sit on
// different ranks. The send carries the transfer's cost (transfer_bytes); the receive costs
// nothing and marks the arrival, so the link is counted once. Throws ScheduleError with the
// checker's findings if the schedule is not valid or deadlocks.
LoweredSchedule lower_schedule(const PipelineSchedule& schedule, const LoweringOptions& options,
                               rt::GraphBuilder& builder);

struct PipelineReplay {
  rt::Nanos makespan = 0;
  std::vector<rt::Nanos> busy;  // per rank, the union of its compute tasks' spans
  // As simulate_schedule defines them: idle over all ranks (makespan - busy) divided by the
  // total busy time, and by p * makespan.
  double bubble_over_ideal = 0;
  double idle_over_total = 0;
  // Per rank, the MemoryTracker's activation peak in units of one micro-batch's activations on
  // a rank (v chunks' worth).
  std::vector<double> peak_activations;
  rt::Trace trace;
};

// Lowers the schedule and replays it on the virtual clock under `model` (one compute engine per
// device), running the tasks' work so a MemoryTracker of the replay's own counts the
// activations (options.memory is ignored; a chunk_activation_bytes of 0 counts 1 byte).
PipelineReplay replay_schedule(const PipelineSchedule& schedule, LoweringOptions options,
                               const rt::CostModel& model);

}  // namespace weave::graphs
