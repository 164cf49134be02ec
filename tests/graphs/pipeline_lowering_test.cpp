// Pipeline schedules lowered to task graphs: the graph has the schedule's tasks and transfers,
// and on the virtual clock it shows the bubble of the formulas and the dry run, the activation
// peaks of the theory in a MemoryTracker, and the transfers' cost when they have one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "weave/graphs/pipeline_lowering.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"
#include "weave/graphs/pipeline_schedule_simulation.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

bool mentions(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// One FLOP per nanosecond and one byte per nanosecond: F lasts 1000 ns, B 2000, I and W 1000,
// the unit model of the dry run scaled by 1000.
LoweringOptions unit_costs(double transfer_bytes = 0) {
  return {.forward_flops = 1000,
          .backward_flops = 2000,
          .backward_input_flops = 1000,
          .backward_weight_flops = 1000,
          .transfer_bytes = transfer_bytes};
}

rt::UniformCostModel unit_model(rt::Nanos latency = 0) {
  return rt::UniformCostModel(1e9, latency, 1e9);
}

PipelineReplay replay(ScheduleKind kind, const ScheduleParams& params) {
  return replay_schedule(make_schedule(kind, params), unit_costs(), unit_model());
}

std::string describe(ScheduleKind kind, const ScheduleParams& c) {
  return std::string(schedule_name(kind)) + " p=" + std::to_string(c.ranks) +
         " m=" + std::to_string(c.micro_batches) + " v=" + std::to_string(c.chunks) +
         " N=" + std::to_string(c.group_size);
}

// ------------------------------------------------------------------------------- the graph

TEST(PipelineLowering, OneComputeTaskPerActionAndATransferPerCrossRankDependency) {
  const PipelineSchedule s =
      make_schedule(ScheduleKind::OneFOneB, {.ranks = 2, .micro_batches = 3});
  rt::GraphBuilder builder;
  const LoweredSchedule lowered = lower_schedule(s, unit_costs(), builder);
  const rt::Graph graph = builder.build();
  ASSERT_EQ(lowered.tasks.size(), 2u);
  // Each micro-batch crosses forward (stage 0 to 1) and back (stage 1 to 0): 3 * 2 transfers.
  EXPECT_EQ(lowered.transfers.size(), 6u);
  EXPECT_EQ(graph.size(), 12u + 2 * 6u);
  const rt::TaskTable& tasks = graph.tasks();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(lowered.tasks[r].size(), s.actions[r].size());
    for (std::size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      const rt::TaskInfo& info = tasks[lowered.tasks[r][i]];
      EXPECT_EQ(info.device, static_cast<rt::DeviceId>(r));
      EXPECT_EQ(info.kind, rt::TaskKind::compute);
      EXPECT_EQ(tasks.stream_name(info.stream), "compute");
      EXPECT_EQ(info.tags.micro_batch, a.micro_batch);
      EXPECT_EQ(info.tags.virtual_stage, r);
      EXPECT_EQ(info.tags.phase,
                a.type == ActionType::Forward ? rt::Phase::forward : rt::Phase::backward);
      EXPECT_EQ(info.cost.flops, a.type == ActionType::Forward ? 1000 : 2000);
    }
  }
  EXPECT_EQ(tasks.name(lowered.tasks[1][2]), "r1.F1.c0");  // r1: F0 B0 F1 B1 F2 B2
  for (const PipelineTransfer& t : lowered.transfers) {
    EXPECT_EQ(tasks[t.send].device, static_cast<rt::DeviceId>(t.from_rank));
    EXPECT_EQ(tasks[t.receive].device, static_cast<rt::DeviceId>(t.to_rank));
    EXPECT_NE(t.from_rank, t.to_rank);
    EXPECT_EQ(tasks[t.send].kind, rt::TaskKind::comm);
    EXPECT_EQ(tasks[t.receive].kind, rt::TaskKind::comm);
    EXPECT_EQ(tasks.stream_name(tasks[t.send].stream), "p2p-send");
    EXPECT_EQ(tasks.stream_name(tasks[t.receive].stream), "p2p-recv");
  }
}

TEST(PipelineLowering, TheVLayoutCrossesRanksOnlyBetweenRanks) {
  // p = 2: stages 0 1 2 3 sit on ranks 0 1 1 0, so 1 -> 2 and 2 -> 1 stay on rank 1.
  const PipelineSchedule s =
      make_schedule(ScheduleKind::ZeroBubbleV, {.ranks = 2, .micro_batches = 4, .chunks = 2});
  rt::GraphBuilder builder;
  const LoweredSchedule lowered = lower_schedule(s, unit_costs(), builder);
  EXPECT_EQ(lowered.transfers.size(), 4u * 4u);
  const rt::Graph graph = builder.build();
  EXPECT_EQ(graph.size(), static_cast<std::size_t>(s.compute_actions()) + 2 * 16u);
}

TEST(PipelineLowering, ABrokenScheduleIsRefusedWithTheCheckersFindings) {
  PipelineSchedule s;
  s.name = "crossed";
  s.ranks = 2;
  s.micro_batches = 2;
  using T = ActionType;
  s.actions = {{{T::Forward, 0}, {T::Backward, 0}, {T::Forward, 1}, {T::Backward, 1}},
               {{T::Forward, 1}, {T::Backward, 1}, {T::Forward, 0}, {T::Backward, 0}}};
  rt::GraphBuilder builder;
  try {
    lower_schedule(s, unit_costs(), builder);
    FAIL() << "a deadlocking schedule was lowered";
  } catch (const ScheduleError& e) {
    EXPECT_TRUE(mentions(e.what(), "cannot lower schedule 'crossed'")) << e.what();
    EXPECT_TRUE(mentions(e.what(), "deadlock: rank 0 step 1")) << e.what();
  }
}

// ------------------------------------------------------------------------------- the bubble

void expect_bubble(ScheduleKind kind, const ScheduleParams& params, double expected) {
  const PipelineSchedule s = make_schedule(kind, params);
  const PipelineReplay r = replay_schedule(s, unit_costs(), unit_model());
  const ScheduleReport dry = simulate_schedule(s);
  ASSERT_TRUE(dry.simulated) << describe(kind, params);
  EXPECT_NEAR(r.bubble_over_ideal, expected, 1e-12) << describe(kind, params);
  EXPECT_NEAR(r.bubble_over_ideal, dry.bubble_over_ideal, 1e-12) << describe(kind, params);
  EXPECT_NEAR(r.idle_over_total, dry.idle_over_total, 1e-12) << describe(kind, params);
  EXPECT_EQ(r.makespan, static_cast<rt::Nanos>(dry.makespan * 1000)) << describe(kind, params);
  for (int rank = 0; rank < s.ranks; ++rank)
    EXPECT_EQ(r.busy[rank], static_cast<rt::Nanos>(dry.ranks[rank].busy * 1000));
}

TEST(PipelineLowering, GPipeAndOneFOneBBubbleIsPMinusOneOverMOnTheClock) {
  for (int p : {2, 4})
    for (int m : {p, 2 * p, p + 1}) {
      expect_bubble(ScheduleKind::GPipe, {p, m}, (p - 1.0) / m);
      expect_bubble(ScheduleKind::OneFOneB, {p, m}, (p - 1.0) / m);
    }
  // GPipe over two chunks per rank: (p-1)/(vm), as the interleaved schedules.
  for (int p : {2, 4})
    for (int m : {p, 2 * p, p + 1})
      expect_bubble(ScheduleKind::GPipe, {p, m, 2}, (p - 1.0) / (2 * m));
}

TEST(PipelineLowering, InterleavedBubbleIsPMinusOneOverVMOnTheClock) {
  // Megatron's: m a multiple of p, and not (with a group size that keeps the last group full).
  for (const ScheduleParams c :
       {ScheduleParams{2, 2, 2}, ScheduleParams{2, 4, 2}, ScheduleParams{2, 3, 2, 3},
        ScheduleParams{2, 5, 2, 3}, ScheduleParams{4, 4, 2}, ScheduleParams{4, 8, 2},
        ScheduleParams{4, 10, 2, 5}, ScheduleParams{4, 8, 3}})
    expect_bubble(ScheduleKind::Interleaved, c, (c.ranks - 1.0) / (c.chunks * c.micro_batches));
  // MindSpore's memory-optimised order keeps the same bubble.
  for (int p : {2, 4})
    for (int m : {p, 2 * p, p + 1})
      expect_bubble(ScheduleKind::InterleavedMem, {p, m, 2}, (p - 1.0) / (2 * m));
}

TEST(PipelineLowering, ZeroBubbleH1BeatsOneFOneBOnTheClock) {
  for (int p : {2, 4})
    for (int m : {p, 2 * p}) {
      const PipelineReplay zb = replay(ScheduleKind::ZeroBubbleH1, {p, m});
      const PipelineReplay plain = replay(ScheduleKind::OneFOneB, {p, m});
      EXPECT_LT(zb.makespan, plain.makespan) << p << " " << m;
      // (p-1)(t_F + t_I - t_W) over m(t_F + t_I + t_W): a third of 1F1B's when all are equal.
      EXPECT_NEAR(zb.bubble_over_ideal, (p - 1.0) / (3 * m), 1e-12) << p << " " << m;
      EXPECT_NEAR(zb.bubble_over_ideal * 3, plain.bubble_over_ideal, 1e-12);
    }
  // ZB-V leaves only the start skew of p-1 forwards: 3 / 48 for p = 4, m = 8.
  EXPECT_NEAR(replay(ScheduleKind::ZeroBubbleV, {4, 8, 2}).bubble_over_ideal, 3.0 / 48, 1e-12);
}

// ------------------------------------------------------------------------------- the memory

TEST(PipelineLowering, MemoryTrackerPeaksFollowTheTheory) {
  for (int p : {2, 4})
    for (int m : {p, 2 * p, p + 1}) {
      const PipelineReplay gpipe = replay(ScheduleKind::GPipe, {p, m});
      const PipelineReplay one = replay(ScheduleKind::OneFOneB, {p, m});
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(gpipe.peak_activations[r], m) << p << " " << m << " rank " << r;
        EXPECT_EQ(one.peak_activations[r], p - r) << p << " " << m << " rank " << r;
      }
    }
  for (const ScheduleParams c : {ScheduleParams{2, 4, 2}, ScheduleParams{4, 8, 2},
                                 ScheduleParams{4, 10, 2, 5}, ScheduleParams{4, 8, 3}}) {
    const int n = c.group_size ? c.group_size : c.ranks;
    const PipelineReplay megatron = replay(ScheduleKind::Interleaved, c);
    const ScheduleReport dry = simulate_schedule(make_schedule(ScheduleKind::Interleaved, c));
    for (int r = 0; r < c.ranks; ++r) {
      const int chunks =
          std::min(2 * (c.ranks - r - 1) + (c.chunks - 1) * n + 1, c.micro_batches * c.chunks);
      EXPECT_DOUBLE_EQ(megatron.peak_activations[r], static_cast<double>(chunks) / c.chunks)
          << describe(ScheduleKind::Interleaved, c) << " rank " << r;
      EXPECT_DOUBLE_EQ(megatron.peak_activations[r], dry.ranks[r].peak_activations);
    }
  }
  // MindSpore's memory-optimised interleaving holds p micro-batches on rank 0 when p divides m,
  // less than Megatron's p + (p-1)/v.
  for (int p : {2, 4})
    for (int v : {2, 3}) {
      const ScheduleParams c{p, 2 * p, v};
      const PipelineReplay mem = replay(ScheduleKind::InterleavedMem, c);
      const PipelineReplay megatron = replay(ScheduleKind::Interleaved, c);
      EXPECT_EQ(mem.peak_activations[0], p) << p << " " << v;
      EXPECT_DOUBLE_EQ(megatron.peak_activations[0], p + (p - 1.0) / v) << p << " " << v;
      for (int r = 0; r < p; ++r)
        EXPECT_DOUBLE_EQ(mem.peak_activations[r], (p * (v - 1.0) + p - r) / v) << p << v << r;
    }
}

TEST(PipelineLowering, EveryForwardsActivationsAreReleasedByItsBackward) {
  for (const auto& [kind, params] :
       {std::pair{ScheduleKind::OneFOneB, ScheduleParams{4, 8}},
        std::pair{ScheduleKind::ZeroBubbleH1, ScheduleParams{4, 8}},
        std::pair{ScheduleKind::ZeroBubbleV, ScheduleParams{4, 8, 2}}}) {
    const PipelineSchedule s = make_schedule(kind, params);
    rt::MemoryTracker memory(4);
    LoweringOptions options = unit_costs();
    options.chunk_activation_bytes = 100;
    options.memory = &memory;
    rt::GraphBuilder builder;
    lower_schedule(s, options, builder);
    const rt::Graph graph = builder.build();
    const rt::UniformCostModel model = unit_model();
    rt::VirtualClock(model, {.execute = true}).run(graph);
    const ScheduleReport dry = simulate_schedule(s);
    for (rt::DeviceId d = 0; d < 4; ++d) {
      EXPECT_EQ(memory.current(d, rt::MemoryCategory::activations), 0) << schedule_name(kind);
      EXPECT_EQ(memory.peak(d, rt::MemoryCategory::activations),
                std::llround(dry.ranks[d].peak_activations * s.chunks * 100))
          << schedule_name(kind) << " rank " << d;
    }
  }
}

// ------------------------------------------------------------------------------ transfers

TEST(PipelineLowering, TransferCostLengthensTheCriticalPathByHand) {
  // p = 2, m = 1 GPipe is one chain: F0 on r0, send, F0 on r1, B0 on r1, send, B0 on r0.
  const PipelineSchedule s = make_schedule(ScheduleKind::GPipe, {.ranks = 2, .micro_batches = 1});
  const PipelineReplay free = replay_schedule(s, unit_costs(0), unit_model(100));
  EXPECT_EQ(free.makespan, 1000 + 1000 + 2000 + 2000);
  // 500 bytes at a byte per ns plus 100 ns of latency: 600 ns per transfer, two transfers.
  const PipelineReplay paid = replay_schedule(s, unit_costs(500), unit_model(100));
  EXPECT_EQ(paid.makespan, 6000 + 2 * 600);
  const rt::Span* send = paid.trace.find("r0.F0.c0.send>r1");
  ASSERT_NE(send, nullptr);
  EXPECT_EQ(send->start, 1000);
  EXPECT_EQ(send->end, 1600);
  const rt::Span* forward = paid.trace.find("r1.F0.c0");
  ASSERT_NE(forward, nullptr);
  EXPECT_EQ(forward->start, 1600);
  // Busy time stays the compute: the bubble grows by the two transfers on both ranks.
  EXPECT_EQ(paid.busy[0], 3000);
  EXPECT_EQ(paid.busy[1], 3000);
  EXPECT_NEAR(paid.bubble_over_ideal, (2 * 7200 - 6000.0) / 6000, 1e-12);
}

TEST(PipelineLowering, OneFOneBWithTransfersPaysThemOnTheWarmUpAndCoolDown) {
  // p = 2, m = 2 1F1B. r0: F0 F1 B0 B1, r1: F0 B0 F1 B1; F 1000, B 2000, transfers 300.
  // r0 F0 0-1000, send 1000-1300; r1 F0 1300-2300, B0 2300-4300, send 4300-4600;
  // r0 F1 1000-2000, send 2000-2300 (after the first send), r1 F1 4300-5300, B1 5300-7300,
  // send 7300-7600; r0 B0 4600-6600, B1 7600-9600.
  const PipelineSchedule s =
      make_schedule(ScheduleKind::OneFOneB, {.ranks = 2, .micro_batches = 2});
  const PipelineReplay r = replay_schedule(s, unit_costs(300), unit_model());
  EXPECT_EQ(r.makespan, 9600);
  EXPECT_EQ(r.trace.find("r0.B0.c0")->start, 4600);
  EXPECT_EQ(r.trace.find("r1.F1.c0")->start, 4300);
}

// ------------------------------------------------------------------------------- host work

TEST(PipelineLowering, HostWorkRunsOncePerActionAfterItsInputs) {
  const PipelineSchedule s =
      make_schedule(ScheduleKind::Interleaved, {.ranks = 2, .micro_batches = 4, .chunks = 2});
  std::vector<std::pair<int, Action>> ran;
  LoweringOptions options = unit_costs();
  options.work = [&](const Action& a, int rank) { ran.emplace_back(rank, a); };
  rt::GraphBuilder builder;
  lower_schedule(s, options, builder);
  const rt::Graph graph = builder.build();
  const rt::UniformCostModel model = unit_model();
  rt::VirtualClock(model, {.execute = true}).run(graph);
  ASSERT_EQ(static_cast<int>(ran.size()), s.compute_actions());
  // A forward of stage k runs after that of stage k-1; a backward of stage k after k+1's.
  const auto position = [&](ActionType type, int stage, int mb) {
    for (std::size_t i = 0; i < ran.size(); ++i) {
      const auto& [rank, a] = ran[i];
      if (a.type == type && a.micro_batch == mb && s.stage(rank, a.chunk) == stage)
        return static_cast<int>(i);
    }
    return -1;
  };
  for (int mb = 0; mb < 4; ++mb)
    for (int stage = 1; stage < s.stages(); ++stage) {
      EXPECT_LT(position(ActionType::Forward, stage - 1, mb),
                position(ActionType::Forward, stage, mb));
      EXPECT_LT(position(ActionType::Backward, stage, mb),
                position(ActionType::Backward, stage - 1, mb));
    }
}

}  // namespace
}  // namespace weave::graphs
