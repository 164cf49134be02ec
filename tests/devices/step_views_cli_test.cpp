// `weave predict` and `weave train` showing a step: the critical path equals the step time the
// prediction reports, a what-if prints the replay of the changed step, --dump-graph draws the
// view the filter and level choose, and wrong views are refused before any work.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "run_weave.hpp"

namespace weave::cli_test {
namespace {

const char* kPredict =
    "predict --num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
    "--seq-length 64 --num-experts 4 --moe-layer-freq 2 --devices 4 "
    "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
    "--ampipe-degree 2 --global-batch-size 4 --device-flops 1e12 --link nvlink4";

std::filesystem::path scratch(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / fmt::format("weave-views-{}", ::getpid());
  std::filesystem::create_directories(dir);
  return dir / name;
}

double number_after(const std::string& out, const std::string& pattern) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(out, m, std::regex(pattern))) << pattern << "\n" << out;
  return m.size() > 1 ? std::stod(m[1]) : -1;
}

TEST(StepViewsCli, CriticalPathIsThePredictedStepAndWhatIfReplaysTheChangedStep) {
  const Result r = weave(std::string(kPredict) + " --critical-path --what-if ep=free");
  ASSERT_EQ(r.status, 0) << r.out;
  const double step = number_after(r.out, "\nstep +([0-9.]+) ms");
  const double path = number_after(r.out, "critical path: [0-9]+ steps, ([0-9.]+) ms");
  EXPECT_DOUBLE_EQ(path, step);
  EXPECT_NE(r.out.find("compute "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("communication "), std::string::npos) << r.out;
  const double before = number_after(r.out, "what-if ep=free: step ([0-9.]+) ms");
  const double after = number_after(r.out, "what-if ep=free: step [0-9.]+ ms -> ([0-9.]+) ms");
  EXPECT_DOUBLE_EQ(before, step);
  EXPECT_LT(after, before) << r.out;  // the Ampipe chunks' all-to-alls are on the path
}

TEST(StepViewsCli, DumpGraphDrawsTheFilteredViewAtTheChosenLevel) {
  const auto dot = scratch("layer.dot");
  const Result r = weave(fmt::format(
      "{} --dump-graph {} --graph-filter device=1 --graph-level layer", kPredict, dot.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("at layer level, written to"), std::string::npos) << r.out;
  std::stringstream text;
  text << std::ifstream(dot).rdbuf();
  const std::string s = text.str();
  EXPECT_EQ(s.rfind("digraph", 0), 0u);
  EXPECT_NE(s.find("cluster_d1 "), std::string::npos);
  for (int d : {0, 2, 3})
    EXPECT_EQ(s.find(fmt::format("cluster_d{} ", d)), std::string::npos) << d;
  EXPECT_NE(s.find("layer 1 F"), std::string::npos);
  EXPECT_EQ(s.find(" t0 "), std::string::npos);  // no node per task
  std::filesystem::remove_all(dot.parent_path());
}

TEST(StepViewsCli, WrongViewsAreRefusedNamingTheFlag) {
  Result r = weave(std::string(kPredict) + " --dump-graph x.dot --graph-filter colour=red");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--graph-filter"), std::string::npos) << r.out;
  r = weave(std::string(kPredict) + " --dump-graph x.dot --graph-level stage");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("stage-micro-batch"), std::string::npos) << r.out;
  r = weave(std::string(kPredict) + " --what-if ep=free");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("add --critical-path"), std::string::npos) << r.out;
  r = weave(std::string(kPredict) + " --critical-path --what-if ep=cheap");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("<stream>=free"), std::string::npos) << r.out;
}

// --figure ampipe writes the layer's figure (both chunks' attention, dispatch, experts and
// combine, forward and backward) where --figure-out says; --figure pipeline the stages' boxes.
TEST(StepViewsCli, FigureWritesTheAmpipeAndPipelineFiguresOfTheReplay) {
  const auto svg = scratch("ampipe.svg");
  Result r =
      weave(fmt::format("{} --figure ampipe --layer 0 --figure-out {}", kPredict, svg.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("figure: Ampipe figure of layer 0 on device 0 (virtual clock), written to"),
            std::string::npos)
      << r.out;
  std::stringstream text;
  text << std::ifstream(svg).rdbuf();
  const std::string s = text.str();
  for (const char* kind : {"attention", "dispatch", "experts", "combine"})
    for (const char* chunk : {"F0", "F1", "B0", "B1"})
      EXPECT_TRUE(std::regex_search(
          s, std::regex(fmt::format("data-kind=\"[a-z_]*{}[a-z_]*\" data-phase=\"{}\" "
                                    "data-chunk=\"{}\"",
                                    kind, chunk[0], chunk[1]))))
          << kind << " " << chunk;
  const auto pipeline = scratch("pipeline.svg");
  r = weave(fmt::format(
      "predict --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
      "--pipeline-model-parallel-size 2 --global-batch-size 4 --device-flops 1e12 --link nvlink4 "
      "--figure pipeline --figure-out {}",
      pipeline.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  std::stringstream ptext;
  ptext << std::ifstream(pipeline).rdbuf();
  EXPECT_NE(ptext.str().find(">rank 1</text>"), std::string::npos);
  EXPECT_NE(ptext.str().find("class=\"micro-batch\""), std::string::npos);
  std::filesystem::remove_all(svg.parent_path());
}

// --report writes one page holding the step's document, and a report it cannot write or that
// advice would have to write for many steps is refused before any work.
TEST(StepViewsCli, ReportWritesOnePageOrIsRefusedNamingTheFlag) {
  const auto page = scratch("step.html");
  Result r = weave(fmt::format("{} --report {}", kPredict, page.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("report: "), std::string::npos) << r.out;
  std::stringstream text;
  text << std::ifstream(page).rdbuf();
  EXPECT_EQ(text.str().rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(text.str().find("\"critical_path\":"), std::string::npos);
  // weave train writes its page once it has trained, with the memory its devices held.
  r = weave(fmt::format(
      "train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --devices 2 "
      "--tensor-model-parallel-size 2 --mock-data --train-iters 1 --report {}",
      page.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("report: "), std::string::npos) << r.out;
  std::stringstream trained;
  trained << std::ifstream(page).rdbuf();
  EXPECT_NE(trained.str().find("\"title\":\"weave train\""), std::string::npos);
  EXPECT_NE(trained.str().find("measured: each device's tracker"), std::string::npos);
  r = weave(std::string(kPredict) + " --report /nonexistent-folder/step.html");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--report '/nonexistent-folder/step.html'"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\nstep "), std::string::npos) << r.out;  // refused before predicting
  r = weave(std::string(kPredict) + " --advise --report x.html");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--report shows one step's replay"), std::string::npos) << r.out;
  std::filesystem::remove_all(page.parent_path());
}

// weave train --critical-path prints the modelled machine's path before training and, after it,
// the path of iteration --trace-iteration as it ran on the wall clock, its shares by kind summing
// to its length; a run that does not train that iteration says which to give.
TEST(StepViewsCli, TrainPrintsThePathOnBothClocks) {
  const std::string train =
      "train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --devices 2 "
      "--tensor-model-parallel-size 2 --mock-data --train-iters 2 --critical-path";
  Result r = weave(train + " --trace-iteration 2");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("critical path: "), std::string::npos) << r.out;
  const auto wall = r.out.find("critical path on the wall clock, iteration 2: ");
  ASSERT_NE(wall, std::string::npos) << r.out;
  const double length = number_after(
      r.out, "critical path on the wall clock, iteration 2: [0-9]+ steps, ([0-9.]+) ms");
  EXPECT_GT(length, 0);
  // The "by kind" lines after the wall-clock headline, up to "by what".
  const std::string kinds = r.out.substr(wall, r.out.find("  by what", wall) - wall);
  EXPECT_NE(kinds.find("waits: host scheduling and launch"), std::string::npos) << kinds;
  double summed = 0;
  int lines = 0;
  const std::regex line(R"(\n    .*\S\s+([0-9.]+) ms\s+[0-9.]+ %)");
  for (auto it = std::sregex_iterator(kinds.begin(), kinds.end(), line);
       it != std::sregex_iterator(); ++it, ++lines)
    summed += std::stod((*it)[1]);
  ASSERT_GT(lines, 1) << kinds;
  EXPECT_NEAR(summed, length, 0.0005 * (lines + 1)) << kinds;  // each printed to 3 decimals
  r = weave(train + " --trace-iteration 3");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("iteration 3 (--trace-iteration) was not trained by this run: give "
                       "--trace-iteration from 1 to 2"),
            std::string::npos)
      << r.out;
}

TEST(StepViewsCli, WrongFiguresAreRefusedNamingTheFlagAndTheFix) {
  const std::pair<const char*, const char*> cases[] = {
      {" --figure ampipe", "add --layer L, L from 0 to 1"},
      {" --figure ampipe --layer 2", "--layer 2 is not a layer of the model: give one from 0 to 1"},
      {" --figure ampipe --layer 0 --figure-device 4", "give one from 0 to 3 (4 devices)"},
      {" --figure gantt", "--figure"},
      {" --layer 1", "add --figure ampipe"},
      {" --figure pipeline --layer 1", "--figure pipeline draws every stage"},
      {" --figure ampipe --layer 0 --figure-out /nonexistent-dir/a.svg", "does not exist"},
      {" --figure ampipe --layer 0 --ampipe-advise", "--figure draws one step's replay"},
  };
  for (const auto& [flags, message] : cases) {
    const Result r = weave(std::string(kPredict) + flags);
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_NE(r.out.find(message), std::string::npos) << flags << "\n" << r.out;
  }
}

}  // namespace
}  // namespace weave::cli_test
