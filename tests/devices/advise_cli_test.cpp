// Advice on predict's engine end to end: `weave predict --advise` ranks the parallel plans and
// prints flags that reproduce its best prediction; --ampipe-advise and --pipeline-advise (weave
// train and weave predict) predict each candidate and never name one that does not fit.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "run_weave.hpp"

namespace weave::cli_test {
namespace {

const char* kDense =
    "predict --num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
    "--seq-length 64 --swiglu --devices 4 --global-batch-size 8 --device-flops 1e12 --link "
    "nvlink4";

const char* kMoe =
    "--mock-data --devices 8 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    "--ffn-hidden-size 128 --seq-length 64 --num-experts 8 --expert-model-parallel-size 8 "
    "--moe-expert-capacity-factor 1 --link ampipe-20gbps --device-flops 3e13";

double number_after(const std::string& text, const std::string& pattern) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(pattern))) return -1;
  return std::stod(m[1]);
}

TEST(AdviseCli, BestPlansFlagsReproduceItsPrediction) {
  const Result r = weave(std::string(kDense) + " --advise --advise-top 3");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("refused"), std::string::npos) << r.out;
  const double best = number_after(r.out, "best: ([0-9.]+) ms a step");
  ASSERT_GT(best, 0) << r.out;
  // The table's first row is the best, and the rows are ranked by step time.
  std::smatch row;
  std::string rest = r.out;
  std::vector<double> steps;
  const std::regex step_column(
      R"(\n +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +(?:-|\S+(?: v[0-9])?) +[0-9]+ +(?:none|full) +([0-9.]+))");
  while (std::regex_search(rest, row, step_column)) {
    steps.push_back(std::stod(row[1]));
    rest = row.suffix();
  }
  ASSERT_EQ(steps.size(), 3u) << r.out;
  EXPECT_EQ(steps.front(), best);
  EXPECT_TRUE(std::is_sorted(steps.begin(), steps.end())) << r.out;
  std::smatch command;
  ASSERT_TRUE(std::regex_search(r.out, command, std::regex("run it: weave (predict [^\n]+)")))
      << r.out;
  const Result again = weave(command[1]);
  ASSERT_EQ(again.status, 0) << again.out;
  EXPECT_EQ(number_after(again.out, "step +([0-9.]+) ms"), best) << again.out;
}

TEST(AdviseCli, DiscardsPlansThatDoNotFit) {
  const Result all = weave(std::string(kDense) + " --advise");
  ASSERT_EQ(all.status, 0) << all.out;
  EXPECT_EQ(number_after(all.out, "([0-9]+) discarded for memory"), 0) << all.out;
  // 2.5 MiB a device: the plans that keep more are discarded, the best is among the rest.
  const Result tight = weave(std::string(kDense) + " --advise --device-memory 0.00244");
  ASSERT_EQ(tight.status, 0) << tight.out;
  EXPECT_GT(number_after(tight.out, "([0-9]+) discarded for memory"), 0) << tight.out;
  EXPECT_GE(number_after(tight.out, "best: ([0-9.]+) ms"),
            number_after(all.out, "best: ([0-9.]+) ms"));
  const Result both = weave(std::string("train ") + kMoe + " --ampipe-advise --pipeline-advise");
  EXPECT_NE(both.status, 0);
  EXPECT_NE(both.out.find("two searches: give one"), std::string::npos) << both.out;
  const Result none = weave(std::string(kDense) + " --advise --device-memory 0.0001");
  EXPECT_EQ(none.status, 1) << none.out;
  EXPECT_NE(none.out.find("no predicted parallel plan fits the device's memory"), std::string::npos)
      << none.out;
}

TEST(AdviseCli, StopsAtTheCandidateLimit) {
  const Result r = weave(std::string(kDense) + " --advise --advise-limit 5");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("stopping at the candidate limit: predicting the 5 of"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("not predicted (--advise-limit)"), std::string::npos) << r.out;
}

// A memory budget below any candidate's estimate predicts one at a time, and advises the same.
TEST(AdviseCli, AMemoryBudgetPredictsOneAtATimeAlike) {
  const std::string search = std::string(kDense) + " --advise --advise-limit 6";
  const Result free = weave(search);
  ASSERT_EQ(free.status, 0) << free.out;
  EXPECT_NE(free.out.find("side by side: at most "), std::string::npos) << free.out;
  const Result tiny = weave(search + " --advise-memory-budget 0.000001");
  ASSERT_EQ(tiny.status, 0) << tiny.out;
  EXPECT_NE(tiny.out.find("side by side: at most 1 predictions at once"), std::string::npos)
      << tiny.out;
  EXPECT_NE(tiny.out.find("(--advise-memory-budget 1.0 KiB)"), std::string::npos) << tiny.out;
  const auto best = [](const std::string& out) {
    const std::size_t at = out.find("best: ");
    return at == std::string::npos ? std::string() : out.substr(at);
  };
  EXPECT_FALSE(best(free.out).empty()) << free.out;
  EXPECT_EQ(best(tiny.out), best(free.out));
  const Result alone = weave(std::string(kDense) + " --advise-memory-budget 4");
  EXPECT_NE(alone.status, 0);
  EXPECT_NE(alone.out.find("--advise-memory-budget shapes --advise's search: add --advise"),
            std::string::npos)
      << alone.out;
}

TEST(AdviseCli, RefusesWhatItCannotSearch) {
  const std::pair<const char*, const char*> cases[] = {
      {" --advise-top 3", "--advise-top shapes --advise's search: add --advise"},
      {" --advise --ampipe-advise", "three searches: give one"},
      {" --advise --trace advise.json", "--trace writes one step's replay"},
      {" --advise --advise-top 0", "--advise-top"},
  };
  for (const auto& [flags, message] : cases) {
    const Result r = weave(std::string(kDense) + flags);
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_NE(r.out.find(message), std::string::npos) << flags << "\n" << r.out;
  }
  // A global batch no data-parallel size divides into whole micro-batches everywhere.
  const Result r = weave(
      "predict --num-layers 3 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
      "--seq-length 63 --devices 5 --global-batch-size 5 --micro-batch-size 5 --advise");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("no parallel plan over 5 devices passes the rules"), std::string::npos)
      << r.out;
}

TEST(AdviseCli, AmpipeAdviceRunsOnPredictsEngine) {
  for (const std::string command : {"train", "predict"}) {
    // --ampipe-advise-fast changes nothing now and is still accepted.
    const Result r = weave(command + " " + kMoe + " --ampipe-advise --ampipe-advise-fast");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("memory per device"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("best: --ampipe-degree "), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("does not fit"), std::string::npos) << r.out;
  }
  const Result none =
      weave(std::string("predict ") + kMoe + " --ampipe-advise --device-memory 0.0001");
  EXPECT_EQ(none.status, 1) << none.out;
  EXPECT_NE(none.out.find("does not fit"), std::string::npos) << none.out;
  EXPECT_NE(none.out.find("no Ampipe degree fits the device's memory"), std::string::npos)
      << none.out;
}

TEST(AdviseCli, PipelineAdviceNamesTheFastestThatFits) {
  const std::string config =
      "predict --num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
      "--seq-length 64 --pipeline-model-parallel-size 2 --global-batch-size 8 --device-flops "
      "1e12 --link nvlink4 --pipeline-advise";
  const Result r = weave(config);
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("memory per device"), std::string::npos) << r.out;
  std::smatch best;
  ASSERT_TRUE(std::regex_search(r.out, best, std::regex("best: --pipeline-scheduler (\\S+)")))
      << r.out;
  // Each row's memory: give the device the least any schedule needs, and every schedule that
  // needs more is marked and passed over.
  std::smatch row;
  std::string rest = r.out;
  double least = 1e30;
  const std::regex memory_column(
      R"(\n[a-z0-9-]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+  ([0-9.]+) MiB)");
  while (std::regex_search(rest, row, memory_column)) {
    least = std::min(least, std::stod(row[1]));
    rest = row.suffix();
  }
  ASSERT_LT(least, 1e30) << r.out;
  const Result tight = weave(config + " --device-memory " + std::to_string((least + 0.05) / 1024));
  ASSERT_EQ(tight.status, 0) << tight.out;
  EXPECT_NE(tight.out.find("(does not fit)"), std::string::npos) << tight.out;
  std::smatch chosen;
  ASSERT_TRUE(std::regex_search(tight.out, chosen, std::regex("best: --pipeline-scheduler (\\S+)")))
      << tight.out;
  const std::string chosen_row = fmt::format("\n{} [^\n]*\\(does not fit\\)", chosen[1].str());
  EXPECT_FALSE(std::regex_search(tight.out, std::regex(chosen_row))) << tight.out;
}

}  // namespace
}  // namespace weave::cli_test
