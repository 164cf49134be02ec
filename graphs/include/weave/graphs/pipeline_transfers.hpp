// A pipeline schedule with its transfers placed: the one lowering pass every consumer of a
// schedule runs (the task-graph replay of `weave schedule` and the training step's pipeline).
//
// A schedule lists compute only (pipeline_schedule.hpp). Lowering walks it in an order that
// respects every dependency between stages and adds, for each activation or input gradient that
// moves between two stages, a send step right after the action that makes it and a receive step
// right before the action that needs it. PyTorch's pipelining (`_add_send_recv`) makes the same
// pass: a SEND_F or SEND_B after a compute action, and the matching RECV_F or RECV_B appended to
// the peer's actions (there when the send is placed; here right before its consumer). So which
// tensor goes where, to which peer and in which order is decided here once.
#pragma once

#include <vector>

#include "weave/graphs/pipeline_schedule.hpp"

namespace weave::graphs {

// One action of a schedule: the rank and the action's index in the rank's list.
struct ScheduledAction {
  int rank = 0;
  int index = 0;
};

// Every action of the schedule (idle slots included) in an order that respects every
// dependency between ranks, each rank's in its list order: a forward after the previous stage's
// forward, a full or input-gradient backward after the next stage's. A graph built in this order
// has each stream's order consistent with its data flow, so stream order never adds a cycle,
// and a transfer built next to its producer never waits behind a later one. Throws ScheduleError
// if the schedule cannot get past a step (check it with simulate_schedule first).
std::vector<ScheduledAction> emission_order(const PipelineSchedule& schedule);

// What moves between two stages: a stage's output forward to the next stage, or its input
// gradient back to the previous one.
enum class TransferDirection { Activations, Gradients };

// One tensor that crosses from one stage to a neighbour for one micro-batch.
struct StageTransfer {
  TransferDirection direction = TransferDirection::Activations;
  int micro_batch = 0;
  int from_stage = 0, to_stage = 0;
  int from_rank = 0, to_rank = 0;

  // Both stages on one rank (the turn of the V layout): no link is crossed.
  bool local() const { return from_rank == to_rank; }
};

enum class LoweredStepType {
  Compute,  // the schedule's action `action` on `rank`
  Send,     // `rank` sends `transfer`, right after `action` made it
  Receive,  // `rank` receives `transfer`, right before `action` needs it
};

struct LoweredStep {
  LoweredStepType type = LoweredStepType::Compute;
  ScheduledAction action;  // the compute action the step runs, or follows (send), or precedes
  int transfer = -1;       // send and receive: the index in LoweredPipeline::transfers
};

struct LoweredPipeline {
  // Every step of every rank in one order that respects every dependency: a rank's own steps
  // are the rank's program in order (its compute actions in list order, each send right after
  // its producer, each receive right before its consumer).
  std::vector<LoweredStep> steps;
  // In the order their sends are placed. Local transfers are listed and placed too.
  std::vector<StageTransfer> transfers;
};

// Places the schedule's transfers. Throws ScheduleError as emission_order does.
LoweredPipeline lower_transfers(const PipelineSchedule& schedule);

}  // namespace weave::graphs
