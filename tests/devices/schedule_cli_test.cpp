// `weave schedule` end to end: the printed order and figures, the files it writes and reads, and
// its refusals.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "run_weave.hpp"

namespace {

using weave::cli_test::Result;
using weave::cli_test::weave;

std::filesystem::path scratch(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / fmt::format("weave-schedule-cli-{}", ::getpid());
  std::filesystem::create_directories(dir);
  return dir / name;
}

std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool mentions(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

int count(const std::string& text, const std::string& part) {
  int n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1))
    ++n;
  return n;
}

const char* kFourByEight = "--pipeline-model-parallel-size 4 --num-micro-batches 8";

TEST(CliSchedule, OneFOneBPrintsTheOrderTheBubbleAndThePeaks) {
  const Result r = weave(fmt::format("schedule {} --pipeline-scheduler 1f1b", kFourByEight));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(mentions(r.out, "r0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7\n")) << r.out;
  EXPECT_TRUE(mentions(r.out, "r3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7\n")) << r.out;
  EXPECT_TRUE(mentions(r.out, "bubble / ideal: 0.375 simulated, 0.375 in theory (p-1)/m")) << r.out;
  EXPECT_TRUE(mentions(r.out, "    0       24        9          4        4  step 3 (F3)")) << r.out;
}

TEST(CliSchedule, InterleavedWritesSvgAndCsvThatLoadsBack) {
  const auto svg = scratch("interleaved.svg"), csv = scratch("interleaved.csv");
  const Result r =
      weave(fmt::format("schedule {} --pipeline-scheduler interleaved --virtual-pipeline-size 2 "
                        "--svg {} --csv {}",
                        kFourByEight, svg.string(), csv.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(mentions(r.out, "bubble / ideal: 0.188 simulated, 0.188 in theory (p-1)/(vm)"))
      << r.out;
  EXPECT_TRUE(mentions(r.out, "5.5      5.5  step 10 (F6)")) << r.out;
  const std::string picture = slurp(svg);
  EXPECT_EQ(picture.rfind("<?xml", 0), 0u);
  EXPECT_TRUE(mentions(picture, "</svg>"));
  EXPECT_EQ(count(picture, "class=\"action\""), 4 * 2 * 8 * 2);
  // The CSV loads back to the same order and figures.
  const Result back = weave(fmt::format("schedule --load-csv {}", csv.string()));
  ASSERT_EQ(back.status, 0) << back.out;
  const auto order = [](const std::string& out) { return out.substr(out.find("r0:")); };
  EXPECT_EQ(order(back.out).substr(0, order(back.out).find("time per chunk")),
            order(r.out).substr(0, order(r.out).find("time per chunk")));
  EXPECT_TRUE(mentions(back.out, "bubble / ideal: 0.188 simulated")) << back.out;
  std::filesystem::remove_all(svg.parent_path());
}

TEST(CliSchedule, TimesChangeTheZeroBubbleFigures) {
  const Result r = weave(fmt::format(
      "schedule {} --pipeline-scheduler zb-h1 --forward-time 2 --backward-input-time 1.5 "
      "--backward-weight-time 1",
      kFourByEight));
  ASSERT_EQ(r.status, 0) << r.out;
  // (p-1)(2 + 1.5 - 1) / (8 (2 + 1.5 + 1)) = 7.5 / 36
  EXPECT_TRUE(mentions(r.out, "bubble / ideal: 0.208 simulated, 0.208 in theory")) << r.out;
}

TEST(CliSchedule, ReplaysTheTaskGraphOnTheVirtualClockAndWritesItsTrace) {
  const auto trace = scratch("replay.json");
  Result r = weave(fmt::format("schedule {} --pipeline-scheduler 1f1b --trace {}", kFourByEight,
                               trace.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(
      mentions(r.out, "task graph on the virtual clock: makespan 33, bubble 0.375 (theory 0.375)"))
      << r.out;
  EXPECT_TRUE(mentions(r.out, "memory tracker peak activations per rank: 4 3 2 1\n")) << r.out;
  const std::string json = slurp(trace);
  EXPECT_TRUE(mentions(json, "\"r3.B7.c0\"")) << json.substr(0, 400);
  EXPECT_TRUE(mentions(json, "p2p-send"));
  // GPipe with p = 2, m = 1 is one chain of F, F, B, B and two transfers: 6 + 2 * 0.5.
  r = weave(
      "schedule --pipeline-model-parallel-size 2 --num-micro-batches 1 --pipeline-scheduler "
      "gpipe --transfer-time 0.5");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(mentions(r.out,
                       "task graph on the virtual clock (transfers 0.5): makespan 7, "
                       "bubble 1.333 (theory 1.000)"))
      << r.out;
  std::filesystem::remove_all(trace.parent_path());
}

TEST(CliSchedule, UnknownSchedulerGetsADidYouMean) {
  const Result r = weave(fmt::format("schedule {} --pipeline-scheduler zb-h2", kFourByEight));
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(mentions(r.out, "unknown pipeline schedule 'zb-h2' (did you mean 'zb-h1'?)"))
      << r.out;
}

TEST(CliSchedule, BadSizesAreRefusedWithTheRuleAndTheNumbers) {
  Result r = weave(
      "schedule --pipeline-model-parallel-size 4 --num-micro-batches 10 --pipeline-scheduler "
      "interleaved");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(mentions(r.out, "m mod N = 0 or >= p")) << r.out;
  EXPECT_TRUE(mentions(r.out, "--microbatch-group-size-per-virtual-pipeline-stage to 5")) << r.out;
  r = weave("schedule --pipeline-model-parallel-size 0 --num-micro-batches 8");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(mentions(r.out, "at least 1 (got '0')")) << r.out;
  r = weave(fmt::format("schedule {} --virtual-pipeline-size 2", kFourByEight));
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(mentions(r.out, "1f1b runs one chunk per rank (got --virtual-pipeline-size 2)"))
      << r.out;
  r = weave("schedule --num-micro-batches 8");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(mentions(r.out, "needs --pipeline-model-parallel-size")) << r.out;
}

TEST(CliSchedule, ABrokenCsvIsReportedAndStillDrawn) {
  const auto csv = scratch("deadlock.csv"), svg = scratch("deadlock.svg");
  std::ofstream(csv) << "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n";
  Result r = weave(fmt::format("schedule --load-csv {} --svg {}", csv.string(), svg.string()));
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(mentions(r.out, "deadlock: rank 0 step 1 (B0, stage 0) waits for")) << r.out;
  EXPECT_TRUE(mentions(slurp(svg), "deadlock"));
  std::ofstream(csv) << "0F0,0B0\n1F0,1Q0\n";
  r = weave(fmt::format("schedule --load-csv {}", csv.string()));
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(mentions(r.out, "line 2, cell 2 ('1Q0'): unknown action type 'Q'")) << r.out;
  r = weave(fmt::format("schedule --load-csv {} --pipeline-model-parallel-size 3", csv.string()));
  EXPECT_NE(r.status, 0);
  std::ofstream(csv) << "0F0,0B0\n1F0,1B0\n";
  r = weave(fmt::format("schedule --load-csv {} --pipeline-model-parallel-size 3", csv.string()));
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(mentions(r.out, "has 2 rows, one per rank, but --pipeline-model-parallel-size is 3"))
      << r.out;
  std::filesystem::remove_all(csv.parent_path());
}

}  // namespace
