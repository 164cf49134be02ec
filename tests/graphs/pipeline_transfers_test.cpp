// The transfer placement every consumer of a schedule runs: one send and one receive per tensor
// that crosses between stages, the send right after the action that makes it on the producer's
// rank, the receive right before the action that needs it on the consumer's, the peer the
// layout's. Links the schedule library alone: it needs nothing of the model or the step.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "weave/graphs/pipeline_schedule_generators.hpp"
#include "weave/graphs/pipeline_transfers.hpp"

namespace weave::graphs {
namespace {

const Action& action_at(const PipelineSchedule& s, const ScheduledAction& at) {
  return s.actions[static_cast<std::size_t>(at.rank)][static_cast<std::size_t>(at.index)];
}

// One rank's steps in PyTorch's text form: "0F0 SEND_F0 RECV_B0 0B0".
std::string rank_steps(const PipelineSchedule& s, const LoweredPipeline& lowered, int rank) {
  std::string out;
  for (const LoweredStep& step : lowered.steps) {
    const bool sends = step.type == LoweredStepType::Send;
    const int runs_on = step.type == LoweredStepType::Compute
                            ? step.action.rank
                            : (sends ? lowered.transfers[step.transfer].from_rank
                                     : lowered.transfers[step.transfer].to_rank);
    if (runs_on != rank) continue;
    if (!out.empty()) out += ' ';
    if (step.type == LoweredStepType::Compute) {
      out += to_stage_string(s, rank, action_at(s, step.action));
      continue;
    }
    const StageTransfer& t = lowered.transfers[step.transfer];
    out += std::string(sends ? "SEND_" : "RECV_") +
           (t.direction == TransferDirection::Activations ? "F" : "B") +
           std::to_string(t.micro_batch);
  }
  return out;
}

TEST(PipelineTransfers, OneFOneBSendsAfterTheProducerAndReceivesBeforeTheConsumer) {
  const PipelineSchedule s =
      make_schedule(ScheduleKind::OneFOneB, {.ranks = 2, .micro_batches = 2});
  const LoweredPipeline lowered = lower_transfers(s);
  // r0: F0 F1 B0 B1, r1: F0 B0 F1 B1.
  EXPECT_EQ(rank_steps(s, lowered, 0), "0F0 SEND_F0 0F1 SEND_F1 RECV_B0 0B0 RECV_B1 0B1");
  EXPECT_EQ(rank_steps(s, lowered, 1), "RECV_F0 1F0 1B0 SEND_B0 RECV_F1 1F1 1B1 SEND_B1");
  ASSERT_EQ(lowered.transfers.size(), 4u);
  const StageTransfer& first = lowered.transfers.front();
  EXPECT_EQ(first.direction, TransferDirection::Activations);
  EXPECT_EQ(first.micro_batch, 0);
  EXPECT_EQ(first.from_stage, 0);
  EXPECT_EQ(first.to_stage, 1);
  EXPECT_EQ(first.from_rank, 0);
  EXPECT_EQ(first.to_rank, 1);
  EXPECT_FALSE(first.local());
}

TEST(PipelineTransfers, EveryTransferIsSentOnceBeforeItIsReceivedOnce) {
  for (const auto& [kind, params] :
       {std::pair{ScheduleKind::GPipe, ScheduleParams{4, 8}},
        std::pair{ScheduleKind::OneFOneB, ScheduleParams{4, 8}},
        std::pair{ScheduleKind::Interleaved, ScheduleParams{4, 8, 2}},
        std::pair{ScheduleKind::InterleavedMem, ScheduleParams{4, 8, 2}},
        std::pair{ScheduleKind::ZeroBubbleH1, ScheduleParams{4, 8}},
        std::pair{ScheduleKind::ZeroBubbleV, ScheduleParams{4, 8, 2}}}) {
    const PipelineSchedule s = make_schedule(kind, params);
    const LoweredPipeline lowered = lower_transfers(s);
    const std::string name(schedule_name(kind));
    // Each micro-batch crosses every stage boundary forward and back.
    ASSERT_EQ(lowered.transfers.size(),
              static_cast<std::size_t>(2 * (s.stages() - 1) * s.micro_batches))
        << name;
    std::vector<int> sent(lowered.transfers.size(), -1), received(lowered.transfers.size(), -1);
    int computes = 0;
    for (int i = 0; i < static_cast<int>(lowered.steps.size()); ++i) {
      const LoweredStep& step = lowered.steps[i];
      if (step.type == LoweredStepType::Compute) {
        ++computes;
        continue;
      }
      const StageTransfer& t = lowered.transfers[step.transfer];
      const Action& a = action_at(s, step.action);
      if (step.type == LoweredStepType::Send) {
        EXPECT_EQ(sent[step.transfer], -1) << name;
        sent[step.transfer] = i;
        // Right after the action that made it, on the producer's rank and stage.
        const LoweredStep& before = lowered.steps[i - 1];
        EXPECT_EQ(before.type, LoweredStepType::Compute) << name;
        EXPECT_EQ(before.action.rank, step.action.rank) << name;
        EXPECT_EQ(before.action.index, step.action.index) << name;
        EXPECT_EQ(step.action.rank, t.from_rank) << name;
        EXPECT_EQ(s.stage(t.from_rank, a.chunk), t.from_stage) << name;
      } else {
        EXPECT_EQ(received[step.transfer], -1) << name;
        received[step.transfer] = i;
        // Right before the action that needs it, on the consumer's rank and stage.
        const LoweredStep& after = lowered.steps[i + 1];
        EXPECT_EQ(after.type, LoweredStepType::Compute) << name;
        EXPECT_EQ(after.action.index, step.action.index) << name;
        EXPECT_EQ(step.action.rank, t.to_rank) << name;
        EXPECT_EQ(s.stage(t.to_rank, a.chunk), t.to_stage) << name;
      }
      EXPECT_EQ(a.micro_batch, t.micro_batch) << name;
      EXPECT_EQ(s.rank_of(t.to_stage), t.to_rank) << name;
      EXPECT_EQ(t.to_stage - t.from_stage, t.direction == TransferDirection::Activations ? 1 : -1)
          << name;
    }
    EXPECT_EQ(computes, static_cast<int>(emission_order(s).size())) << name;
    for (std::size_t t = 0; t < lowered.transfers.size(); ++t) {
      EXPECT_GE(sent[t], 0) << name << " transfer " << t;
      EXPECT_GT(received[t], sent[t]) << name << " transfer " << t;
    }
  }
}

TEST(PipelineTransfers, TheVLayoutsTurnStaysOnItsRank) {
  // p = 2: stages 0 1 2 3 sit on ranks 0 1 1 0, so 1 -> 2 and 2 -> 1 are local to rank 1.
  const PipelineSchedule s =
      make_schedule(ScheduleKind::ZeroBubbleV, {.ranks = 2, .micro_batches = 4, .chunks = 2});
  const LoweredPipeline lowered = lower_transfers(s);
  int local = 0;
  for (const StageTransfer& t : lowered.transfers)
    if (t.local()) {
      ++local;
      EXPECT_EQ(t.from_rank, 1);
      EXPECT_EQ(std::min(t.from_stage, t.to_stage), 1);
      EXPECT_EQ(std::max(t.from_stage, t.to_stage), 2);
    }
  EXPECT_EQ(local, 2 * 4);
  EXPECT_EQ(lowered.transfers.size(), 6u * 4u);
}

TEST(PipelineTransfers, ADeadlockedScheduleIsRefused) {
  PipelineSchedule s;
  s.name = "crossed";
  s.ranks = 2;
  s.micro_batches = 2;
  using T = ActionType;
  s.actions = {{{T::Forward, 0}, {T::Backward, 0}, {T::Forward, 1}, {T::Backward, 1}},
               {{T::Forward, 1}, {T::Backward, 1}, {T::Forward, 0}, {T::Backward, 0}}};
  try {
    lower_transfers(s);
    FAIL() << "a deadlocking schedule was lowered";
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot order schedule 'crossed': rank 0 cannot get "
                                         "past step 1"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace weave::graphs
