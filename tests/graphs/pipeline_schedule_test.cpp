// Pipeline schedules: the generators reproduce the published orders, the dry run reproduces the
// bubble and memory formulas, the checker names what is wrong with a broken schedule, and the
// CSV and SVG forms hold together.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "weave/graphs/pipeline_schedule.hpp"
#include "weave/graphs/pipeline_schedule_csv.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"
#include "weave/graphs/pipeline_schedule_simulation.hpp"
#include "weave/graphs/pipeline_schedule_svg.hpp"

namespace weave::graphs {
namespace {

bool mentions(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string all_problems(const ScheduleReport& report) {
  std::string out;
  for (const auto& p : report.problems)
    out += p + "\n";
  return out;
}

std::string refusal(ScheduleKind kind, ScheduleParams params) {
  try {
    make_schedule(kind, params);
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "accepted";
}

void expect_orders(const PipelineSchedule& s, const std::vector<std::string>& ranks) {
  ASSERT_EQ(s.ranks, static_cast<int>(ranks.size()));
  for (int r = 0; r < s.ranks; ++r)
    EXPECT_EQ(format_rank(s, r), ranks[r]) << s.name << " rank " << r;
}

// ----------------------------------------------------------------- the reference orders, p=4 m=8

// Chunks per rank each schedule is drawn with: 2 for the interleaved and V layouts.
int chunks_of(ScheduleKind kind) {
  return kind == ScheduleKind::Interleaved || kind == ScheduleKind::InterleavedMem ||
                 kind == ScheduleKind::ZeroBubbleV
             ? 2
             : 1;
}

TEST(PipelineSchedule, GPipeRunsAllForwardsThenAllBackwards) {
  const auto s = make_schedule(ScheduleKind::GPipe, {.ranks = 4, .micro_batches = 8});
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(format_rank(s, r), "F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7");
  const auto chunked =
      make_schedule(ScheduleKind::GPipe, {.ranks = 2, .micro_batches = 2, .chunks = 2});
  EXPECT_EQ(format_rank(chunked, 0), "F0 F1 F0' F1' B0' B1' B0 B1");
}

TEST(PipelineSchedule, OneFOneBMatchesTheReference) {
  expect_orders(make_schedule(ScheduleKind::OneFOneB, {.ranks = 4, .micro_batches = 8}),
                {"F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                 "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                 "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                 "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"});
}

TEST(PipelineSchedule, MegatronInterleavedMatchesTheReference) {
  expect_orders(
      make_schedule(ScheduleKind::Interleaved, {.ranks = 4, .micro_batches = 8, .chunks = 2}),
      {"F0 F1 F2 F3 F0' F1' F2' F3' F4 F5 F6 B0' F7 B1' F4' B2' F5' B3' F6' B0 F7' B1 B2 B3 B4' "
       "B5' B6' B7' B4 B5 B6 B7",
       "F0 F1 F2 F3 F0' F1' F2' F3' F4 B0' F5 B1' F6 B2' F7 B3' F4' B0 F5' B1 F6' B2 F7' B3 B4' "
       "B5' B6' B7' B4 B5 B6 B7",
       "F0 F1 F2 F3 F0' F1' F2' B0' F3' B1' F4 B2' F5 B3' F6 B0 F7 B1 F4' B2 F5' B3 F6' B4' F7' "
       "B5' B6' B7' B4 B5 B6 B7",
       "F0 F1 F2 F3 F0' B0' F1' B1' F2' B2' F3' B3' F4 B0 F5 B1 F6 B2 F7 B3 F4' B4' F5' B5' F6' "
       "B6' F7' B7' B4 B5 B6 B7"});
}

TEST(PipelineSchedule, MindSporeMemoryOptimisedMatchesTheReference) {
  const std::string megatron_rank3 =
      "F0 F1 F2 F3 F0' B0' F1' B1' F2' B2' F3' B3' F4 B0 F5 B1 F6 B2 F7 B3 F4' B4' F5' B5' F6' "
      "B6' F7' B7' B4 B5 B6 B7";
  expect_orders(
      make_schedule(ScheduleKind::InterleavedMem, {.ranks = 4, .micro_batches = 8, .chunks = 2}),
      {"F0 F1 F2 F3 F0' F1' F2' F3' B0' F4 B1' F5 B2' F6 B3' F7 B0 F4' B1 F5' B2 F6' B3 F7' B4' "
       "B5' B6' B7' B4 B5 B6 B7",
       "F0 F1 F2 F3 F0' F1' F2' B0' F3' B1' F4 B2' F5 B3' F6 B0 F7 B1 F4' B2 F5' B3 F6' B4' F7' "
       "B5' B6' B7' B4 B5 B6 B7",
       "F0 F1 F2 F3 F0' F1' B0' F2' B1' F3' B2' F4 B3' F5 B0 F6 B1 F7 B2 F4' B3 F5' B4' F6' B5' "
       "F7' B6' B7' B4 B5 B6 B7",
       megatron_rank3});
}

TEST(PipelineSchedule, ZeroBubbleH1MatchesTheReference) {
  expect_orders(make_schedule(ScheduleKind::ZeroBubbleH1, {.ranks = 4, .micro_batches = 8}),
                {"F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
                 "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
                 "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
                 "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7"});
}

TEST(PipelineSchedule, ZeroBubbleVMatchesTheReference) {
  const auto s =
      make_schedule(ScheduleKind::ZeroBubbleV, {.ranks = 4, .micro_batches = 8, .chunks = 2});
  EXPECT_EQ(s.layout, StageLayout::V);
  EXPECT_EQ(s.stage(0, 1), 7);
  EXPECT_EQ(s.stage(3, 1), 4);
  expect_orders(
      s, {"F0 F1 F2 F3 F4 F5 F6 F0' I0' W0' F1' I1' W1' F2' I2' W2' F3' I3' W3' F7 I0 W0 F4' I4' "
          "W4' I1 W1 F5' I5' W5' I2 W2 F6' I6' W6' I3 W3 F7' I7' W7' I4 W4 I5 W5 I6 W6 I7 W7",
          "F0 F1 F2 F3 F4 F0' F5 F1' I0' W0' F2' I1' W1' F3' I2' W2' F6 I0 W0 F4' I3' W3' F7 I1 "
          "W1 F5' I4' W4' I2 W2 F6' I5' W5' I3 W3 F7' I6' W6' I4 I7' I5 W4 I6 W5 I7 W6 W7' W7",
          "F0 F1 F2 F0' F3 F1' F4 F2' I0' W0' F3' I1' W1' F5 I0 W0 F4' I2' W2' F6 I1 W1 F5' I3' "
          "W3' F7 I2 W2 F6' I4' W4' I3 W3 F7' I5' W5' I4 I6' I5 I7' I6 W4 I7 W5 W6' W7' W6 W7",
          "F0 F0' F1 F1' F2 F2' F3 F3' I0' W0' F4 I0 W0 F4' I1' W1' F5 I1 W1 F5' I2' W2' F6 I2 W2 "
          "F6' I3' W3' F7 I3 W3 F7' I4' W4' I4 I5' I5 I6' I6 I7' I7 W4 W5' W6' W7' W5 W6 W7"});
}

TEST(PipelineSchedule, ZeroBubbleVWithFewMicroBatchesDropsThePadding) {
  const auto s =
      make_schedule(ScheduleKind::ZeroBubbleV, {.ranks = 4, .micro_batches = 3, .chunks = 2});
  const auto report = simulate_schedule(s);
  EXPECT_TRUE(report.simulated) << all_problems(report);
  EXPECT_EQ(s.compute_actions(), 4 * 2 * 3 * 3);
  EXPECT_FALSE(schedule_theory(ScheduleKind::ZeroBubbleV, {4, 3, 2}).caveat.empty());
}

TEST(PipelineSchedule, MegatronStepTableGroupsMicroBatches) {
  // p=2, N=3, m=5, v=2: the last group holds the remaining two micro-batches.
  const auto table = interleaved_step_table(5, 2, 3);
  const std::vector<std::pair<int, int>> expected = {{0, 0}, {1, 0}, {2, 0}, {0, 1}, {1, 1},
                                                     {2, 1}, {3, 0}, {4, 0}, {3, 1}, {4, 1}};
  EXPECT_EQ(table, expected);
  // The schedule built on it runs forward step k from the table and backward step k on the
  // mirrored chunk: rank 1's warm-up is (v-1)N = 3.
  const auto s = make_schedule(ScheduleKind::Interleaved,
                               {.ranks = 2, .micro_batches = 5, .chunks = 2, .group_size = 3});
  EXPECT_EQ(format_rank(s, 1),
            "F0 F1 F2 F0' B0' F1' B1' F2' B2' F3 B0 F4 B1 F3' B2 F4' B3' B4' B3 B4");
  EXPECT_TRUE(simulate_schedule(s).simulated);
}

// ------------------------------------------------------------------------ the bubble formulas

double simulated_bubble(ScheduleKind kind, ScheduleParams params, const TimeModel& time = {}) {
  const auto report = simulate_schedule(make_schedule(kind, params), time);
  EXPECT_TRUE(report.simulated) << all_problems(report);
  return report.bubble_over_ideal;
}

TEST(PipelineSchedule, GPipeAndOneFOneBBubbleIsPMinusOneOverM) {
  for (int p : {1, 2, 3, 4, 6})
    for (int m : {1, 3, 4, 7, 8, 10, 13}) {
      const double expected = (p - 1.0) / m;
      EXPECT_NEAR(simulated_bubble(ScheduleKind::GPipe, {p, m}), expected, 1e-12) << p << " " << m;
      EXPECT_NEAR(simulated_bubble(ScheduleKind::OneFOneB, {p, m}), expected, 1e-12)
          << p << " " << m;
      // The ratio does not depend on the durations.
      EXPECT_NEAR(simulated_bubble(ScheduleKind::OneFOneB, {p, m}, {.forward = 1.5, .backward = 4}),
                  expected, 1e-12);
    }
}

TEST(PipelineSchedule, InterleavedBubbleIsPMinusOneOverVM) {
  struct Case {
    int p, m, v, n;
  };
  // Including m not a multiple of p, with a group size that keeps the last group full enough.
  for (const Case c : {Case{4, 8, 2, 0}, Case{4, 8, 3, 0}, Case{2, 5, 2, 3}, Case{4, 10, 2, 5},
                       Case{3, 8, 2, 5}, Case{4, 12, 4, 0}, Case{3, 7, 3, 7}, Case{4, 8, 2, 8}}) {
    const ScheduleParams params{c.p, c.m, c.v, c.n};
    const double expected = (c.p - 1.0) / (c.v * c.m);
    EXPECT_NEAR(simulated_bubble(ScheduleKind::Interleaved, params), expected, 1e-12)
        << c.p << " " << c.m << " " << c.v << " " << c.n;
    EXPECT_NEAR(schedule_theory(ScheduleKind::Interleaved, params).bubble_over_ideal, expected,
                1e-12);
  }
}

TEST(PipelineSchedule, MemoryOptimisedInterleavingKeepsMegatronsBubble) {
  for (int p : {2, 3, 4})
    for (int m : {p, p + 1, 2 * p, 2 * p + p / 2, 3 * p - 1})
      for (int v : {2, 3}) {
        EXPECT_NEAR(simulated_bubble(ScheduleKind::InterleavedMem, {p, m, v}), (p - 1.0) / (v * m),
                    1e-12)
            << p << " " << m << " " << v;
      }
}

TEST(PipelineSchedule, ZeroBubbleH1BubbleIsPMinusOneTimesFPlusIMinusW) {
  for (const TimeModel t :
       {TimeModel{}, TimeModel{.forward = 2, .backward_input = 1.5, .backward_weight = 1},
        TimeModel{.forward = 1, .backward_input = 1, .backward_weight = 0.5}})
    for (int p : {2, 3, 4, 5})
      for (int m : {p, p + 1, 2 * p, 3 * p + 1}) {
        const double ideal = m * (t.forward + t.backward_input + t.backward_weight);
        const double expected =
            (p - 1) * (t.forward + t.backward_input - t.backward_weight) / ideal;
        EXPECT_NEAR(simulated_bubble(ScheduleKind::ZeroBubbleH1, {p, m}, t), expected, 1e-12)
            << p << " " << m << " F " << t.forward << " I " << t.backward_input;
        EXPECT_NEAR(schedule_theory(ScheduleKind::ZeroBubbleH1, {p, m}, t.forward, t.backward_input,
                                    t.backward_weight)
                        .bubble_over_ideal,
                    expected, 1e-12);
      }
}

TEST(PipelineSchedule, ZeroBubbleH1TheoryWarnsWhenWeightGradientsOutgrowTheGaps) {
  EXPECT_TRUE(schedule_theory(ScheduleKind::ZeroBubbleH1, {4, 8}, 1, 1, 1).caveat.empty());
  const auto long_w = schedule_theory(ScheduleKind::ZeroBubbleH1, {4, 8}, 1, 0.5, 1);
  EXPECT_TRUE(mentions(long_w.caveat, "t_W <= t_F and t_W <= t_I")) << long_w.caveat;
  // The dry run shows why: the bubble is larger than the formula's.
  const auto report =
      simulate_schedule(make_schedule(ScheduleKind::ZeroBubbleH1, {4, 8}),
                        {.forward = 1, .backward_input = 0.5, .backward_weight = 1});
  EXPECT_GT(report.bubble_over_ideal, long_w.bubble_over_ideal + 1e-9);
}

TEST(PipelineSchedule, ZeroBubbleH1BeatsOneFOneB) {
  for (int p : {2, 4, 8})
    for (int m : {p, 2 * p, 3 * p}) {
      const auto zb = simulate_schedule(make_schedule(ScheduleKind::ZeroBubbleH1, {p, m}));
      const auto plain = simulate_schedule(make_schedule(ScheduleKind::OneFOneB, {p, m}));
      EXPECT_LT(zb.makespan, plain.makespan);
      // A third of 1F1B's bubble when F, I and W take equal time.
      EXPECT_NEAR(zb.bubble_over_ideal * 3, plain.bubble_over_ideal, 1e-12);
    }
}

TEST(PipelineSchedule, ZeroBubbleVLeavesOnlyTheStartSkew) {
  const auto report = simulate_schedule(
      make_schedule(ScheduleKind::ZeroBubbleV, {.ranks = 4, .micro_batches = 8, .chunks = 2}));
  ASSERT_TRUE(report.simulated) << all_problems(report);
  EXPECT_NEAR(report.bubble_over_ideal, 3.0 / 48, 1e-12);  // 0.062 in the reference's table
  EXPECT_EQ(report.makespan, 51);
}

TEST(PipelineSchedule, ReferenceTableFiguresForFourRanksEightMicroBatches) {
  struct Row {
    ScheduleKind kind;
    int v;
    double bubble;
    std::vector<double> peaks;
  };
  for (const Row& row : {Row{ScheduleKind::GPipe, 1, 0.375, {8, 8, 8, 8}},
                         Row{ScheduleKind::OneFOneB, 1, 0.375, {4, 3, 2, 1}},
                         Row{ScheduleKind::Interleaved, 2, 0.1875, {5.5, 4.5, 3.5, 2.5}},
                         Row{ScheduleKind::InterleavedMem, 2, 0.1875, {4, 3.5, 3, 2.5}},
                         Row{ScheduleKind::ZeroBubbleH1, 1, 0.125, {4, 4, 4, 4}},
                         Row{ScheduleKind::ZeroBubbleV, 2, 0.0625, {4, 4, 4, 4}}}) {
    const ScheduleParams params{4, 8, row.v};
    const auto report = simulate_schedule(make_schedule(row.kind, params));
    const auto theory = schedule_theory(row.kind, params);
    ASSERT_TRUE(report.simulated) << schedule_name(row.kind);
    EXPECT_NEAR(report.bubble_over_ideal, row.bubble, 1e-12) << schedule_name(row.kind);
    EXPECT_NEAR(theory.bubble_over_ideal, row.bubble, 1e-12) << schedule_name(row.kind);
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(report.ranks[r].peak_activations, row.peaks[r]) << schedule_name(row.kind) << r;
      EXPECT_EQ(theory.peak_activations[r], row.peaks[r]) << schedule_name(row.kind) << r;
    }
  }
}

// ------------------------------------------------------------------------ peak activations

TEST(PipelineSchedule, PeakActivationsPerRankFollowTheFormulas) {
  for (int p : {1, 2, 3, 4, 6})
    for (int m : {1, 2, 5, 8, 12}) {
      const auto gpipe = simulate_schedule(make_schedule(ScheduleKind::GPipe, {p, m}));
      const auto one = simulate_schedule(make_schedule(ScheduleKind::OneFOneB, {p, m}));
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(gpipe.ranks[r].peak_activations, m);
        EXPECT_EQ(one.ranks[r].peak_activations, std::min(p - r, m)) << p << " " << m << " " << r;
      }
      // 1F1B reaches its peak at the first steady forward, after p - r - 1 warm-up forwards.
      if (m >= p) {
        EXPECT_EQ(one.ranks[0].peak_step, p - 1);
      }
    }
  struct Case {
    int p, m, v, n;
  };
  for (const Case c : {Case{4, 8, 2, 0}, Case{4, 8, 3, 0}, Case{4, 10, 2, 5}, Case{2, 5, 2, 3},
                       Case{3, 12, 2, 6}}) {
    const int n = c.n ? c.n : c.p;
    const auto report =
        simulate_schedule(make_schedule(ScheduleKind::Interleaved, {c.p, c.m, c.v, c.n}));
    for (int r = 0; r < c.p; ++r) {
      const int chunks = std::min(2 * (c.p - r - 1) + (c.v - 1) * n + 1, c.m * c.v);
      EXPECT_DOUBLE_EQ(report.ranks[r].peak_activations, static_cast<double>(chunks) / c.v)
          << c.p << " " << c.m << " " << c.v << " " << n << " rank " << r;
    }
  }
  // MindSpore's memory-optimised interleaving holds exactly p micro-batches on rank 0 when p
  // divides m, as plain 1F1B does.
  for (int p : {2, 3, 4, 5})
    for (int v : {2, 3, 4}) {
      const auto report =
          simulate_schedule(make_schedule(ScheduleKind::InterleavedMem, {p, 2 * p, v}));
      EXPECT_EQ(report.ranks[0].peak_activations, p) << p << " " << v;
      for (int r = 0; r < p; ++r)
        EXPECT_DOUBLE_EQ(report.ranks[r].peak_activations,
                         static_cast<double>(p * (v - 1) + p - r) / v);
    }
}

// ---------------------------------------------------------------------- refused parameters

TEST(PipelineSchedule, BadParametersAreRefusedWithTheRuleAndTheNumbers) {
  EXPECT_TRUE(mentions(refusal(ScheduleKind::OneFOneB, {0, 8}), "at least 1 rank"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::OneFOneB, {0, 8}), "got 0"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::GPipe, {4, 0}), "at least 1 micro-batch"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::GPipe, {4, 8, 0}), "at least 1 chunk"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::OneFOneB, {4, 8, 2}),
                       "1f1b runs one chunk per rank (got --virtual-pipeline-size 2)"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::ZeroBubbleH1, {4, 8, 2}), "one chunk per rank"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::ZeroBubbleH1, {4, 3}), "m = 3, p = 4"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::ZeroBubbleV, {4, 8, 3}), "exactly 2 chunks"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::Interleaved, {4, 8, 1}), "at least 2 chunks"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::Interleaved, {4, 8, 2, 3}),
                       "p <= N <= m for the micro-batch group size N (got p = 4, N = 3, m = 8)"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::Interleaved, {4, 8, 2, 9}), "N = 9, m = 8"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::Interleaved, {4, 3, 2}), "N = 4, m = 3"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::Interleaved, {4, 10, 2}),
                       "m mod N = 0 or >= p, else the last group is too small to fill the "
                       "pipeline (got m = 10, N = 4, m mod N = 2, p = 4)"));
  EXPECT_EQ(refusal(ScheduleKind::Interleaved, {4, 10, 2, 5}), "accepted");
  EXPECT_TRUE(mentions(refusal(ScheduleKind::InterleavedMem, {4, 3, 2}),
                       "at least p micro-batches, one per rank in its first round (got m = 3, "
                       "p = 4)"));
  EXPECT_TRUE(mentions(refusal(ScheduleKind::OneFOneB, {4, 8, 1, 4}),
                       "applies to the interleaved schedule only"));
  EXPECT_EQ(refusal(ScheduleKind::OneFOneB, {4, 2}), "accepted");  // Megatron's min(p-r-1, m)
}

TEST(PipelineSchedule, UnknownScheduleNamesGetADidYouMean) {
  EXPECT_EQ(schedule_kind("interleaved-mem"), ScheduleKind::InterleavedMem);
  try {
    schedule_kind("zb-h2");
    FAIL() << "accepted zb-h2";
  } catch (const ScheduleError& e) {
    EXPECT_TRUE(mentions(e.what(), "unknown pipeline schedule 'zb-h2' (did you mean 'zb-h1'?)"))
        << e.what();
    EXPECT_TRUE(mentions(e.what(), "gpipe, 1f1b, interleaved, interleaved-mem, zb-h1, zb-v"));
  }
}

// ---------------------------------------------------------------------------------- checker

TEST(PipelineSchedule, CheckerFindsADeadlockAndNamesWhoWaitsForWhat) {
  // Rank 0 waits for micro-batch 0's gradient, which rank 1 only computes after micro-batch 1's
  // forward, which rank 0 only sends after that backward.
  const auto s = read_schedule_csv(
      "0F0,0B0,0F1,0B1\n"
      "1F1,1B1,1F0,1B0\n");
  const auto report = simulate_schedule(s);
  EXPECT_FALSE(report.simulated);
  const std::string problems = all_problems(report);
  EXPECT_TRUE(mentions(problems,
                       "deadlock: rank 0 step 1 (B0, stage 0) waits for the input gradient of "
                       "micro-batch 0 from stage 1 (B0 or I0), which rank 1 runs at step 3, but "
                       "rank 1 is stuck at step 0 (F1, stage 1)"))
      << problems;
  EXPECT_TRUE(mentions(problems, "deadlock: rank 1 step 0 (F1, stage 1) waits for F1 of stage 0"))
      << problems;
}

TEST(PipelineSchedule, CheckerFindsMissingDuplicatedAndOutOfOrderActions) {
  const std::string good =
      write_schedule_csv(make_schedule(ScheduleKind::OneFOneB, {.ranks = 2, .micro_batches = 3}));
  ASSERT_TRUE(simulate_schedule(read_schedule_csv(good)).valid());
  // 1F1B on 2 ranks: r0 F0 F1 B0 F2 B1 B2, r1 F0 B0 F1 B1 F2 B2.
  auto missing =
      simulate_schedule(read_schedule_csv("0F0,0F1,0B0,0F2,0B1\n1F0,1B0,1F1,1B1,1F2,1B2\n"));
  EXPECT_TRUE(mentions(all_problems(missing),
                       "missing backward: rank 0 never runs B2 of stage 0 (or I2 and W2)"))
      << all_problems(missing);
  EXPECT_FALSE(missing.simulated);
  auto duplicate = simulate_schedule(
      read_schedule_csv("0F0,0F1,0B0,0F2,0B1,0B2,0F1\n1F0,1B0,1F1,1B1,1F2,1B2\n"));
  EXPECT_TRUE(mentions(all_problems(duplicate),
                       "duplicate: F1 of stage 0 runs 2 times, on rank 0 at steps 1, 6"))
      << all_problems(duplicate);
  auto backwards_first =
      simulate_schedule(read_schedule_csv("0F0,0B1,0B0,0F2,0F1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n"));
  EXPECT_TRUE(mentions(all_problems(backwards_first),
                       "out of order: rank 0 step 1 (B1, stage 0) comes before its forward at "
                       "step 4"))
      << all_problems(backwards_first);
  auto split = simulate_schedule(read_schedule_csv("0F0,0W0,0I0\n1F0,1I0,1W0\n"));
  EXPECT_TRUE(mentions(all_problems(split), "comes before its input gradient"));
  auto half = simulate_schedule(read_schedule_csv("0F0,0I0\n1F0,1B0,1W0\n"));
  EXPECT_TRUE(mentions(all_problems(half), "rank 0 runs I0 of stage 0 but never W0"));
  EXPECT_TRUE(mentions(all_problems(half), "both a full backward (B) and a split one"));
  auto beyond = simulate_schedule(read_schedule_csv("0F0,0B0\n1F0,1B0\n", "csv", 1));
  EXPECT_TRUE(beyond.simulated);
  auto too_many = read_schedule_csv("0F0,0B0,0F1,0B1\n1F0,1B0,1F1,1B1\n");
  too_many.micro_batches = 1;
  EXPECT_TRUE(mentions(all_problems(simulate_schedule(too_many)),
                       "names micro-batch 1, but the step has micro-batches 0..0 (m = 1)"));
}

TEST(PipelineSchedule, DeliberateIdleSlotsDelayTheRank) {
  const auto s = read_schedule_csv("0F0, ,0B0\n1F0,1B0\n");
  ASSERT_EQ(s.actions[0].size(), 3u);
  EXPECT_EQ(s.actions[0][1].type, ActionType::Idle);
  const auto report = simulate_schedule(s);
  ASSERT_TRUE(report.simulated) << all_problems(report);
  // F0 0-1 on rank 0, F0 1-2 and B0 2-4 on rank 1; rank 0 idles 1-2 anyway, then B0 4-6.
  EXPECT_EQ(report.makespan, 6);
  EXPECT_EQ(report.ranks[0].busy, 3);
}

// ---------------------------------------------------------------------------------------- CSV

TEST(PipelineSchedule, CsvRoundTripsEverySchedule) {
  for (const auto& name : schedule_names()) {
    const ScheduleKind kind = schedule_kind(name);
    const int v = chunks_of(kind);
    const auto s = make_schedule(kind, {.ranks = 4, .micro_batches = 8, .chunks = v});
    const std::string csv = write_schedule_csv(s);
    const auto back = read_schedule_csv(csv, s.name);
    EXPECT_EQ(back.ranks, s.ranks) << name;
    EXPECT_EQ(back.micro_batches, s.micro_batches) << name;
    EXPECT_EQ(back.chunks, s.chunks) << name;
    EXPECT_EQ(back.layout, s.layout) << name;
    EXPECT_EQ(back.actions, s.actions) << name;
    EXPECT_EQ(write_schedule_csv(back), csv) << name;
  }
  const auto one = make_schedule(ScheduleKind::OneFOneB, {.ranks = 2, .micro_batches = 2});
  EXPECT_TRUE(mentions(write_schedule_csv(one), "\n0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"));
}

TEST(PipelineSchedule, CsvAcceptsWhitespaceCommentsStagelessCellsAndCommunication) {
  const auto s = read_schedule_csv(
      "# a hand-written 1F1B\r\n"
      "\n"
      " 0 F 0 , F1, 0SEND_F0, 0B0 ,0B1 ,,\n"
      "1RECV_F0,F0,1B0,1F1,1B1\n");
  EXPECT_EQ(s.ranks, 2);
  EXPECT_EQ(s.micro_batches, 2);
  EXPECT_EQ(format_schedule(s), "r0: F0 F1 B0 B1\nr1: F0 B0 F1 B1\n");
  const auto interleaved = read_schedule_csv("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n");
  EXPECT_EQ(interleaved.chunks, 2);
  EXPECT_EQ(interleaved.layout, StageLayout::Interleaved);
  const auto v = read_schedule_csv("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n");
  EXPECT_EQ(v.layout, StageLayout::V);
  EXPECT_TRUE(simulate_schedule(v).simulated);
}

TEST(PipelineSchedule, CsvErrorsNameTheLineTheCellAndTheForm) {
  const auto error = [](const std::string& text) -> std::string {
    try {
      read_schedule_csv(text);
    } catch (const ScheduleError& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_TRUE(mentions(error("# header\n0F0,0B0\n1F0,1X0\n"),
                       "schedule CSV line 3, cell 2 ('1X0'): unknown action type 'X'; expected "
                       "STAGE TYPE MICRO_BATCH such as 2F0"));
  EXPECT_TRUE(
      mentions(error("0F0,0F\n"), "line 1, cell 2 ('0F'): no micro-batch number after 'F'"));
  EXPECT_TRUE(mentions(error("0F0,07\n"), "cell 2 ('07'): no action type"));
  EXPECT_TRUE(mentions(error("0F0,0B0x\n"), "unexpected 'x' after the micro-batch"));
  EXPECT_TRUE(mentions(error("0F0,1B0\n1F0,1B0\n0F0\n"),
                       "line 1, cell 2 ('1B0'): a stage lives on one rank, and with p = 3 and "
                       "v = 1 the interleaved layout puts stages 0 on rank 0"));
  EXPECT_TRUE(mentions(error("0F0,3F0,2F0\n1F0\n"),
                       "cell 2 ('3F0'): a stage lives on one rank, and with p = 2 and v = 2 the "
                       "interleaved layout puts stages 0, 2 on rank 0 (the V layout: 0, 3; line "
                       "1, cell 3 ('2F0') rules it out)"));
  EXPECT_TRUE(mentions(error("# nothing\n"), "no rows"));
  EXPECT_TRUE(mentions(error("0F0,0B0,0F123456789\n"),
                       "cell 3 ('0F123456789'): micro-batch 123456789 cannot exist in a schedule "
                       "of 3 actions"));
  EXPECT_TRUE(mentions(error("0F0,0B0,999999F0\n"), "stage 999999 cannot exist"));
}

// ---------------------------------------------------------------------------------------- SVG

// A small well-formedness check: tags nest and close, attribute values are quoted, and '&' and
// '<' appear in text only as markup or entities. Returns "" or what is wrong.
std::string xml_problem(const std::string& xml) {
  std::vector<std::string> open;
  std::size_t i = 0;
  const auto entity_ok = [&](std::size_t at) {
    const std::size_t semi = xml.find(';', at);
    if (semi == std::string::npos || semi - at > 8) return false;
    const std::string name = xml.substr(at + 1, semi - at - 1);
    return name == "amp" || name == "lt" || name == "gt" || name == "quot" || name == "apos" ||
           (name.size() > 1 && name[0] == '#');
  };
  bool root_seen = false;
  while (i < xml.size()) {
    if (xml[i] == '&') {
      if (!entity_ok(i)) return "bad entity at " + std::to_string(i);
      ++i;
      continue;
    }
    if (xml[i] != '<') {
      if (open.empty() && !std::isspace(static_cast<unsigned char>(xml[i])))
        return "text outside the root at " + std::to_string(i);
      ++i;
      continue;
    }
    if (xml.compare(i, 5, "<?xml") == 0) {
      if (i != 0) return "declaration not first";
      i = xml.find("?>", i);
      if (i == std::string::npos) return "unclosed declaration";
      i += 2;
      continue;
    }
    const bool closing = xml[i + 1] == '/';
    std::size_t j = i + (closing ? 2 : 1);
    const std::size_t name_begin = j;
    while (j < xml.size() && (std::isalnum(static_cast<unsigned char>(xml[j])) || xml[j] == '-' ||
                              xml[j] == ':' || xml[j] == '_'))
      ++j;
    const std::string name = xml.substr(name_begin, j - name_begin);
    if (name.empty()) return "tag without a name at " + std::to_string(i);
    if (closing) {
      if (open.empty() || open.back() != name) return "unbalanced </" + name + ">";
      open.pop_back();
      if (xml[j] != '>') return "junk in </" + name + ">";
      i = j + 1;
      continue;
    }
    // Attributes: name="value" with no '<' inside the value.
    while (true) {
      while (std::isspace(static_cast<unsigned char>(xml[j])))
        ++j;
      if (xml[j] == '>' || xml.compare(j, 2, "/>") == 0) break;
      const std::size_t attribute = j;
      while (std::isalnum(static_cast<unsigned char>(xml[j])) || xml[j] == '-' || xml[j] == ':')
        ++j;
      if (j == attribute || xml[j] != '=' || xml[j + 1] != '"')
        return "bad attribute in <" + name + "> at " + std::to_string(attribute);
      const std::size_t end = xml.find('"', j + 2);
      if (end == std::string::npos) return "unterminated attribute in <" + name + ">";
      for (std::size_t k = j + 2; k < end; ++k) {
        if (xml[k] == '<') return "'<' in an attribute of <" + name + ">";
        if (xml[k] == '&' && !entity_ok(k)) return "bad entity in an attribute of <" + name + ">";
      }
      j = end + 1;
    }
    if (xml[j] == '/') {
      i = j + 2;
    } else {
      if (open.empty() && root_seen) return "a second root <" + name + ">";
      open.push_back(name);
      root_seen = true;
      i = j + 1;
    }
  }
  if (!open.empty()) return "unclosed <" + open.back() + ">";
  return root_seen ? "" : "no root element";
}

int count(const std::string& text, const std::string& part) {
  int n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1))
    ++n;
  return n;
}

TEST(PipelineSchedule, XmlCheckerCatchesBrokenDocuments) {
  EXPECT_EQ(xml_problem("<svg a=\"1\"><g><text>x &amp; y</text></g><rect/></svg>"), "");
  EXPECT_NE(xml_problem("<svg><g></svg>"), "");
  EXPECT_NE(xml_problem("<svg><text>a & b</text></svg>"), "");
  EXPECT_NE(xml_problem("<svg a=1></svg>"), "");
  EXPECT_NE(xml_problem("<svg></svg><svg></svg>"), "");
}

TEST(PipelineSchedule, SvgIsWellFormedWithOneCellPerAction) {
  for (const auto& name : schedule_names()) {
    const ScheduleKind kind = schedule_kind(name);
    const int v = chunks_of(kind);
    const auto s = make_schedule(kind, {.ranks = 4, .micro_batches = 8, .chunks = v});
    const auto report = simulate_schedule(s);
    const std::string svg = render_schedule_svg(s, report);
    EXPECT_EQ(xml_problem(svg), "") << name;
    EXPECT_EQ(count(svg, "class=\"action\""), s.compute_actions()) << name;
    EXPECT_EQ(count(svg, "class=\"chunk-mark\""), v == 2 ? s.compute_actions() / 2 : 0) << name;
    EXPECT_TRUE(mentions(svg, name + ": p=4, m=8, v=" + std::to_string(v))) << name;
    EXPECT_TRUE(mentions(svg, "bubble 0.")) << name;
    EXPECT_TRUE(mentions(svg, ">rank 3</text>")) << name;
  }
  // A broken schedule is still drawn, step by step, with its first problem.
  auto broken = read_schedule_csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "broken & <odd>");
  const std::string svg = render_schedule_svg(broken, simulate_schedule(broken));
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(count(svg, "class=\"action\""), 8);
  EXPECT_TRUE(mentions(svg, "deadlock"));
  EXPECT_TRUE(mentions(svg, "broken &amp; &lt;odd&gt;"));
}

// At p=8, m=32 every box carries its own micro-batch's number (primed for later chunks) in a
// legible size, and colour follows the phase only: one fill per kind of action.
TEST(PipelineSchedule, SvgNumbersEveryBoxAndColoursByPhaseAtEightByThirtyTwo) {
  const std::regex box(
      "<g><title>rank ([0-9]+) step ([0-9]+):.*?fill=\"(#[0-9a-f]{6})\".*?class=\"micro-batch\""
      "[^>]*font-size=\"([0-9.]+)\"[^>]*>([^<]*)</text></g>");
  for (const std::string name : {"1f1b", "interleaved", "zb-h1", "zb-v"}) {
    const ScheduleKind kind = schedule_kind(name);
    const int v = chunks_of(kind);
    const auto s = make_schedule(kind, {.ranks = 8, .micro_batches = 32, .chunks = v});
    const std::string svg = render_schedule_svg(s, simulate_schedule(s));
    EXPECT_EQ(xml_problem(svg), "") << name;
    std::map<ActionType, std::set<std::string>> fills;
    int boxes = 0;
    std::istringstream lines(svg);
    std::string line;
    std::smatch m;
    while (std::getline(lines, line)) {
      if (line.rfind("<g><title>", 0) != 0) continue;
      ASSERT_TRUE(std::regex_search(line, m, box))
          << name << ": a box without its number: " << line;
      const Action& a = s.actions[std::stoul(m[1])][std::stoul(m[2])];
      const std::string expected =
          std::to_string(a.micro_batch) + std::string(static_cast<std::size_t>(a.chunk), '\'');
      EXPECT_EQ(m[5].str(), expected) << name << ": " << m[0];
      EXPECT_GE(std::stod(m[4]), 7.0) << name << ": " << m[0];
      fills[a.type].insert(m[3]);
      ++boxes;
    }
    EXPECT_EQ(boxes, s.compute_actions()) << name;
    std::set<std::string> all;
    for (const auto& [type, set] : fills) {
      EXPECT_EQ(set.size(), 1u) << name;
      all.insert(set.begin(), set.end());
    }
    EXPECT_EQ(all.size(), fills.size()) << name;  // each phase its own colour
    EXPECT_GE(fills.size(), 2u) << name;
  }
}

TEST(PipelineSchedule, SvgCellWidthsFollowTheSimulatedTimes) {
  const auto s = make_schedule(ScheduleKind::OneFOneB, {.ranks = 1, .micro_batches = 1});
  const std::string svg =
      render_schedule_svg(s, simulate_schedule(s, {.forward = 1, .backward = 3}));
  // Forward 1 unit, backward 3 units wide at 26 pixels per unit.
  EXPECT_TRUE(mentions(svg, "width=\"26.00\"")) << svg;
  EXPECT_TRUE(mentions(svg, "width=\"78.00\"")) << svg;
}

}  // namespace
}  // namespace weave::graphs
