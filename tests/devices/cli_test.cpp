// The `weave` program end to end: exit codes, JSON output, error messages, written files.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "run_weave.hpp"

namespace {

using weave::cli_test::Result;
using weave::cli_test::weave;

TEST(Cli, TopoJsonDescribesEveryDevice) {
  const Result r = weave("topo --devices 8 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["devices"].size(), 8u);
  int cores = j["cores"];
  for (const auto& d : j["devices"]) {
    EXPECT_EQ(d["concurrency"], cores >= 8 ? static_cast<int>(d["cores"].size()) : 1);
    EXPECT_FALSE(d["cores"].empty());
  }
}

TEST(Cli, TopoOnASyntheticHost) {
  const Result r = weave("topo --synthetic 2,2,8 --devices 4 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["numa_nodes"], 4);
  for (int d = 0; d < 4; ++d)
    EXPECT_EQ(j["devices"][d]["numa_node"], d);
}

TEST(Cli, BadInputIsRefusedWithTheRuleAndTheValue) {
  Result r = weave("topo --devices 0");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("at least 1 (got '0')"), std::string::npos) << r.out;
  r = weave("simulate --link nvlink9 --timing model");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("unknown link preset 'nvlink9'"), std::string::npos) << r.out;
  r = weave("topo --synthetic 2,2");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--synthetic takes"), std::string::npos) << r.out;
  r = weave("frobnicate");
  EXPECT_NE(r.status, 0);
}

TEST(Cli, SimulateWritesTracesAndAGraph) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("weave-cli-{}", ::getpid());
  std::filesystem::create_directories(dir);
  const Result r = weave(fmt::format(
      "simulate --devices 4 --layers 1 --chunks 2 --flops 1e5 --bytes 65536 --link ampipe-20gbps "
      "--timing both --iterations 1 --trace {}/t.json --dump-graph {}/g.dot --json",
      dir.string(), dir.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto report = nlohmann::json::parse(r.out);
  ASSERT_EQ(report["clocks"].size(), 2u);
  EXPECT_EQ(report["clocks"][1]["clock"], "virtual");
  EXPECT_GT(report["clocks"][1]["makespan_ns"], 0);
  for (const char* name : {"t.wall.json", "t.model.json"}) {
    std::ifstream in(dir / name);
    ASSERT_TRUE(in) << name;
    const auto trace = nlohmann::json::parse(in);
    EXPECT_GT(trace["traceEvents"].size(), 4u * 2 * 2);
  }
  std::ifstream dot(dir / "g.dot");
  std::string first;
  std::getline(dot, first);
  EXPECT_EQ(first.rfind("digraph", 0), 0u);
  std::filesystem::remove_all(dir);
}

// ------------------------------------------------------------------------------ weave train

std::filesystem::path scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("weave-cli-{}", ::getpid());
  std::filesystem::create_directories(dir);
  return dir / name;
}

const char* kTinyModel =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 32 "
    "--micro-batch-size 2 --log-interval 5 --lr-warmup-iters 2";

TEST(CliTrain, MockDataTrainsAndWritesMetricsAndTrace) {
  const auto metrics = scratch("metrics.jsonl"), trace = scratch("trace.json");
  const Result r = weave(
      fmt::format("train {} --mock-data --train-iters 30 --lr 1e-2 --num-experts 4 --devices 4 "
                  "--tensor-model-parallel-size 2 --sequence-parallel --log-json {} --trace {}",
                  kTinyModel, metrics.string(), trace.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  std::ifstream in(metrics);
  std::string line;
  std::vector<double> losses;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) losses.push_back(j["loss"]);
  }
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_LT(losses.back(), 0.7 * losses.front()) << r.out;  // the mock pattern is learnable
  const auto t = nlohmann::json::parse(std::ifstream(trace));
  EXPECT_GT(t["traceEvents"].size(), 100u);
}

TEST(CliTrain, UnknownFlagsAndKeysGetASuggestion) {
  Result r = weave(fmt::format("train {} --mock-data --num-layer 3", kTinyModel));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("unknown flag '--num-layer'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did you mean '--num-layers'?"), std::string::npos) << r.out;
  const auto config = scratch("bad-key.json");
  std::ofstream(config) << R"({"hiden_size": 64})";
  r = weave(fmt::format("train --mock-data --config {}", config.string()));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("did you mean '--hidden-size'?"), std::string::npos) << r.out;
  std::ofstream(config) << "{not json";
  r = weave(fmt::format("train --mock-data --config {}", config.string()));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("is not valid JSON"), std::string::npos) << r.out;
}

TEST(CliTrain, ConfigFileValuesAreUsedAndFlagsOverrideThem) {
  const auto config = scratch("config.json");
  std::ofstream(config) << R"({"num_layers": 3, "hidden-size": 48, "num-attention-heads": 4,
                              "ffn_hidden_size": 96, "seq_length": 16, "train_iters": 2,
                              "sequence_parallel": true, "tensor_model_parallel_size": 2})";
  const Result r =
      weave(fmt::format("train --mock-data --config {} --num-layers 1", config.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("1 layers, hidden 48"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tp 2 + sp"), std::string::npos) << r.out;
}

TEST(CliTrain, ModelTimingReplaysTheStepOnTheVirtualClock) {
  // The same iterations on the virtual clock: the same losses, modelled times.
  const auto wall = scratch("wall.jsonl"), model = scratch("model.jsonl");
  const std::string common = fmt::format(
      "train {} --mock-data --train-iters 3 --devices 2 --tensor-model-parallel-size 2 "
      "--sequence-parallel",
      kTinyModel);
  Result r = weave(fmt::format("{} --log-json {}", common, wall.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  r = weave(fmt::format("{} --timing model --link nvlink4 --device-flops 1e12 --log-json {}",
                        common, model.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("(modelled)"), std::string::npos) << r.out;
  std::ifstream a(wall), b(model);
  std::string la, lb;
  int lines = 0;
  while (std::getline(a, la) && std::getline(b, lb)) {
    const auto ja = nlohmann::json::parse(la), jb = nlohmann::json::parse(lb);
    EXPECT_EQ(ja["loss"], jb["loss"]);
    EXPECT_GT(jb["seconds"].get<double>(), 0.0);
    ++lines;
  }
  EXPECT_EQ(lines, 3);
}

TEST(CliTrain, AmpipeAdviceComparesDegreesOnTheVirtualClock) {
  const Result r = weave(
      fmt::format("train {} --mock-data --num-experts 4 --devices 2 --expert-model-parallel-size 2 "
                  "--link ampipe-20gbps --device-flops 1e13 --ampipe-advise",
                  kTinyModel));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("best: --ampipe-degree"), std::string::npos) << r.out;
  // 32 positions: degrees 1 to 16 are possible; 16 x 2 chunks of 2 positions is the last.
  EXPECT_NE(r.out.find("     16 "), std::string::npos) << r.out;
}

TEST(CliTrain, PipeExpertsTrainAndAreSwitchedOffByTheRulesWithAWarning) {
  const std::string moe = fmt::format(
      "train {} --mock-data --train-iters 3 --num-experts 4 --devices 2 "
      "--expert-model-parallel-size 2 --moe-layer-freq 1",
      kTinyModel);
  Result r = weave(moe +
                   " --ampipe-degree 2 --use-pipe-experts --pipe-experts-multi-data 4 "
                   "--pipe-experts-separate-streams");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
  // MindSpeed's multi-stream chains all-to-alls with split experts' gathers: it needs SP.
  r = weave(moe + " --use-pipe-experts --pipe-experts-multi-data 2 --pipe-experts-multi-stream");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("warning: --pipe-experts-multi-stream is switched off"), std::string::npos)
      << r.out;
  r = weave(moe +
            " --ampipe-degree 2 --use-pipe-experts --pipe-experts-multi-data 3 "
            "--ampipe-tp-sp-comm-overlap");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("warning: --use-pipe-experts is switched off: --pipe-experts-multi-data "
                       "(3) must be divisible by --ampipe-degree (2)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("warning: --ampipe-tp-sp-comm-overlap is switched off"), std::string::npos)
      << r.out;
  r = weave(moe + " --use-pipe-experts --pipe-experts-multi-data 0");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--pipe-experts-multi-data"), std::string::npos) << r.out;
}

TEST(CliTrain, SizeRulesAreRefusedBeforeAnythingRuns) {
  Result r = weave(fmt::format("train {} --mock-data --tensor-model-parallel-size 3", kTinyModel));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--num-attention-heads (4) must be divisible by "
                       "--tensor-model-parallel-size (3)"),
            std::string::npos)
      << r.out;
  r = weave(
      fmt::format("train {} --mock-data --devices 3 --tensor-model-parallel-size 2", kTinyModel));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--devices (3) must be a multiple"), std::string::npos) << r.out;
}

// The iteration -> loss lines of a --log-json file.
std::map<int, double> logged_losses(const std::filesystem::path& p) {
  std::map<int, double> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j["iteration"]] = j["loss"];
  }
  return out;
}

TEST(CliTrain, SaveThenLoadResumesWithTheSameLosses) {
  const auto ckpt = scratch("model.ckpt");
  const auto full = scratch("full.jsonl"), resumed = scratch("resumed.jsonl");
  Result r = weave(
      fmt::format("train {} --mock-data --train-iters 6 --log-json {}", kTinyModel, full.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  r = weave(fmt::format("train {} --mock-data --train-iters 3 --lr-decay-iters 6 --save {}",
                        kTinyModel, ckpt.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  r = weave(fmt::format("train {} --mock-data --train-iters 6 --load {} --log-json {}", kTinyModel,
                        ckpt.string(), resumed.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto a = logged_losses(full), b = logged_losses(resumed);
  ASSERT_EQ(b.size(), 3u);
  for (const auto& [it, loss] : b)
    EXPECT_EQ(loss, a.at(it)) << "iteration " << it;
  r = weave(fmt::format("train {} --mock-data --hidden-size 64 --train-iters 6 --load {}",
                        kTinyModel, ckpt.string()));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("holds another model"), std::string::npos) << r.out;
}

TEST(CliTrain, PipelineParallelTrainsLikeOneDeviceAndResumesFromACheckpoint) {
  const std::string model =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 "
      "--ffn-hidden-size 64 --seq-length 32 --mock-data --global-batch-size 4";
  const auto serial = scratch("pp_serial.jsonl"), piped = scratch("pp_piped.jsonl");
  Result r = weave(fmt::format("train {} --train-iters 4 --log-interval 1 --log-json {}", model,
                               serial.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  r = weave(
      fmt::format("train {} --train-iters 4 --log-interval 1 --pipeline-model-parallel-size 2 "
                  "--num-layers-per-virtual-pipeline-stage 1 --log-json {}",
                  model, piped.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("pp 2 (interleaved, 2 chunks per rank)"), std::string::npos) << r.out;
  const auto a = logged_losses(serial), b = logged_losses(piped);
  ASSERT_EQ(a.size(), 4u);
  {  // each logged iteration of a pipeline reports its bubble
    std::ifstream in(piped);
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("loss")) continue;
      ASSERT_TRUE(j.contains("pipeline_bubble")) << line;
      EXPECT_GT(j["pipeline_bubble"].get<double>(), 0.0) << line;
    }
  }
  for (const auto& [it, loss] : a)
    EXPECT_NEAR(b.at(it), loss, 1e-4 * loss) << "iteration " << it;
  // A pipelined run saves and resumes: the stages' shards, the tied embedding's two copies.
  const auto ckpt = scratch("pp.ckpt"), resumed = scratch("pp_resumed.jsonl");
  const std::string pp = "--pipeline-model-parallel-size 2 --pipeline-scheduler zb-h1";
  r = weave(fmt::format("train {} {} --train-iters 2 --lr-decay-iters 4 --save {}", model, pp,
                        ckpt.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  r = weave(fmt::format("train {} {} --train-iters 4 --log-interval 1 --load {} --log-json {}",
                        model, pp, ckpt.string(), resumed.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto c = logged_losses(resumed);
  ASSERT_EQ(c.size(), 2u);
  for (const auto& [it, loss] : c)
    EXPECT_NEAR(loss, a.at(it), 1e-4 * loss) << "iteration " << it;
}

TEST(CliTrain, PipelineAdviceComparesEverySchedule) {
  const Result r = weave(
      "train --num-layers 8 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 "
      "--seq-length 32 --mock-data --pipeline-model-parallel-size 4 --global-batch-size 8 "
      "--link nvlink3 --device-flops 1e12 --pipeline-advise");
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* kind : {"gpipe", "1f1b", "interleaved", "interleaved-mem", "zb-h1", "zb-v"})
    EXPECT_NE(r.out.find(fmt::format("\n{} ", kind)), std::string::npos) << kind << r.out;
  EXPECT_NE(r.out.find("best: --pipeline-scheduler"), std::string::npos) << r.out;
  // 1F1B keeps p - r micro-batches on stage r.
  EXPECT_NE(r.out.find("4, "), std::string::npos) << r.out;
}

TEST(CliTrain, PipelineRulesAreRefusedWithTheFlags) {
  const std::string model =
      "--num-layers 4 --hidden-size 32 --num-attention-heads 4 "
      "--ffn-hidden-size 64 --seq-length 32 --mock-data";
  Result r = weave(fmt::format("train {} --pipeline-model-parallel-size 3", model));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--num-layers (4) must be divisible by --pipeline-model-parallel-size"),
            std::string::npos)
      << r.out;
  r = weave(fmt::format(
      "train {} --pipeline-model-parallel-size 2 --pipeline-scheduler zb-h1 --global-batch-size 1",
      model));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("zb-h1 needs at least p micro-batches"), std::string::npos) << r.out;
  r = weave(
      fmt::format("train {} --pipeline-model-parallel-size 2 --pipeline-scheduler 1f1c", model));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("1f1b"), std::string::npos) << r.out;
  r = weave(fmt::format("train {} --pipeline-advise", model));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--pipeline-advise compares pipeline schedules"), std::string::npos)
      << r.out;
}

}  // namespace
