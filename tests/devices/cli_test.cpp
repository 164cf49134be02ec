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
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "run_weave.hpp"

namespace {

using weave::cli_test::Result;
using weave::cli_test::weave;
using weave::cli_test::weave_on_terminal;

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
  // Emptied the first time this process asks: a pid is reused, and a file an earlier process
  // left must not stand in for one a test expects written, or not written.
  static const std::filesystem::path dir = [] {
    const auto d = std::filesystem::temp_directory_path() / fmt::format("weave-cli-{}", ::getpid());
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir / name;
}

const char* kTinyModel =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 32 "
    "--micro-batch-size 2 --log-interval 5 --lr-warmup-iters 2";

// A script's --lr makes the schedule flags it leaves out Megatron-LM's defaults (no warm-up,
// linear decay to 0 over the run); without --lr, weave's own apply.
TEST(CliTrain, ScheduleFlagsLeftOutBesideLrAreMegatrons) {
  const auto rates = [](const std::string& flags) {
    const auto metrics = scratch("lr.jsonl");
    const Result r = weave(
        fmt::format("train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
                    "--mock-data --train-iters 4 --log-interval 1 --log-json {} {}",
                    metrics.string(), flags));
    EXPECT_EQ(r.status, 0) << r.out;
    std::ifstream in(metrics);
    std::string line;
    std::vector<double> lr;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("lr") && j.contains("loss")) lr.push_back(j["lr"]);
    }
    return lr;
  };
  // (--min-lr 3e-4, weave's default, would be above this --lr: it was refused.)
  const std::vector<double> megatron = rates("--lr 5e-7");
  ASSERT_EQ(megatron.size(), 4u);
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(megatron[static_cast<std::size_t>(i)], 5e-7 * (3 - i) / 4.0, 1e-15) << i;
  // What the script gives stays: a warm-up of 2 to 5e-7, then cosine to 1e-7.
  const std::vector<double> given =
      rates("--lr 5e-7 --lr-warmup-iters 2 --lr-decay-style cosine --min-lr 1e-7");
  ASSERT_EQ(given.size(), 4u);
  EXPECT_NEAR(given[0], 2.5e-7, 1e-15);
  EXPECT_NEAR(given[1], 5e-7, 1e-15);
  EXPECT_GT(given[2], 1e-7);
  EXPECT_NEAR(given[3], 1e-7, 1e-15);
}

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

// The first iteration's record of a one-iteration MoE run with `flags` added.
nlohmann::json first_moe_iteration(const std::string& flags) {
  const auto metrics = scratch("router.jsonl");
  const Result r =
      weave(fmt::format("train {} --mock-data --train-iters 1 --num-experts 4 --moe-aux-loss-coeff "
                        "0.01 --log-json {} {}",
                        kTinyModel, metrics.string(), flags));
  EXPECT_EQ(r.status, 0) << r.out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == "iteration") return j;
  }
  ADD_FAILURE() << "no iteration in " << r.out;
  return {};
}

TEST(CliTrain, RouterFlagsTakeMegatronCoresAndMindSpeedsMeanings) {
  const auto plain = first_moe_iteration("");
  EXPECT_GT(plain["aux_loss"].get<double>(), 0);
  // none: no balancing loss whatever the coefficient.
  EXPECT_EQ(first_moe_iteration("--moe-router-load-balancing-type none")["aux_loss"], 0.0);
  // seq_aux_loss: each of a micro-batch's two sequences balanced over its own tokens.
  const auto sequences = first_moe_iteration("--moe-router-load-balancing-type seq_aux_loss");
  EXPECT_GT(sequences["aux_loss"].get<double>(), 0);
  EXPECT_NE(sequences["aux_loss"], plain["aux_loss"]);
  // sinkhorn takes no balancing loss: a coefficient is refused, as Megatron-Core asserts.
  const Result sinkhorn =
      weave(fmt::format("train {} --mock-data --num-experts 4 --moe-aux-loss-coeff 0.01 "
                        "--moe-router-load-balancing-type sinkhorn",
                        kTinyModel));
  EXPECT_NE(sinkhorn.status, 0);
  EXPECT_NE(sinkhorn.out.find("--moe-aux-loss-coeff 0.01: give 0"), std::string::npos)
      << sinkhorn.out;
  // Pre-softmax weights are not renormalised: another loss.
  EXPECT_NE(first_moe_iteration("--moe-router-pre-softmax")["loss"], plain["loss"]);
  // MindSpeed's gate: another loss (its drops at factor 1, its loss per gate call).
  EXPECT_NE(first_moe_iteration("--moe-model-type deepspeed_moe")["loss"], plain["loss"]);
  EXPECT_EQ(
      first_moe_iteration("--moe-model-type deepspeed_moe --moe-no-drop")["loss"],
      first_moe_iteration("--moe-model-type deepspeed_moe --moe-train-capacity-factor 8")["loss"]);
}

TEST(CliTrain, MindSpeedsRulesOverFlagsWithoutEffectAreKept) {
  const Result padding = weave(fmt::format(
      "train {} --mock-data --num-experts 4 --moe-model-type deepspeed_moe --moe-dynamic-padding",
      kTinyModel));
  EXPECT_NE(padding.status, 0);
  EXPECT_NE(padding.out.find("--moe-dynamic-padding applies with --moe-no-drop"), std::string::npos)
      << padding.out;
  const Result mc2 =
      weave(fmt::format("train {} --mock-data --num-experts 4 --use-ascend-mc2", kTinyModel));
  EXPECT_NE(mc2.status, 0);
  EXPECT_NE(mc2.out.find("not compatible with MoE models"), std::string::npos) << mc2.out;
  const Result both = weave(fmt::format(
      "train {} --mock-data --train-iters 1 --num-experts 4 --moe-model-type deepspeed_moe "
      "--moe-no-drop --moe-dynamic-padding",
      kTinyModel));
  EXPECT_EQ(both.status, 0) << both.out;
  // MindSpeed's Ampipe under CP asserts megatron_cp_algo (its default is ulysses_cp_algo).
  const std::string ampipe_cp = fmt::format(
      "train {} --mock-data --train-iters 1 --num-experts 4 --ampipe-degree 2 "
      "--context-parallel-size 2",
      kTinyModel);
  const Result ulysses = weave(ampipe_cp + " --context-parallel-algo ulysses_cp_algo");
  EXPECT_NE(ulysses.status, 0);
  EXPECT_NE(ulysses.out.find("needs --context-parallel-algo megatron_cp_algo (MindSpeed's rule"),
            std::string::npos)
      << ulysses.out;
  EXPECT_NE(ulysses.out.find("got ulysses_cp_algo"), std::string::npos) << ulysses.out;
  const Result unknown = weave(ampipe_cp + " --context-parallel-algo ring");
  EXPECT_NE(unknown.status, 0);
  EXPECT_NE(unknown.out.find("--context-parallel-algo ring is not one of MindSpeed's"),
            std::string::npos)
      << unknown.out;
  const Result ring = weave(ampipe_cp + " --context-parallel-algo megatron_cp_algo");
  EXPECT_EQ(ring.status, 0) << ring.out;
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
  const auto iterations = [](const std::filesystem::path& p) {
    std::vector<nlohmann::json> out;
    std::ifstream in(p);
    for (std::string line; std::getline(in, line);)
      if (const auto j = nlohmann::json::parse(line); j["type"] == "iteration") out.push_back(j);
    return out;
  };
  const auto a = iterations(wall), b = iterations(model);
  int lines = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const auto &ja = a[i], &jb = b[i];
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
  // Within MindSpeed's Ampipe rules (its gate, no linear biases) with split experts (tp 2, SP):
  // nothing to warn of.
  Result r = weave(fmt::format(
      "train {} --mock-data --train-iters 3 --num-experts 4 --devices 4 "
      "--expert-model-parallel-size 2 --moe-layer-freq 1 --tensor-model-parallel-size 2 "
      "--sequence-parallel --ampipe-degree 2 --use-pipe-experts --pipe-experts-multi-data 4 "
      "--pipe-experts-separate-streams --moe-model-type deepspeed_moe --disable-bias-linear",
      kTinyModel));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
  // Whole experts (tp 1): MindSpeed's PipeExpert fails there without the tp-sp overlap, and the
  // warning names it; weave trains.
  r = weave(moe +
            " --ampipe-degree 2 --use-pipe-experts --pipe-experts-multi-data 4 "
            "--pipe-experts-separate-streams --moe-model-type deepspeed_moe "
            "--disable-bias-linear");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("stops with an IndexError after 2 of its 4 slices"), std::string::npos)
      << r.out;
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

// ------------------------------------------------------------- flags scripts carry, and help

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

int occurrences(const std::string& text, const std::string& part) {
  int n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1))
    ++n;
  return n;
}

TEST(CliFlags, FlagsWithoutEffectAreNamedOnceInOneLine) {
  const Result r = weave(fmt::format(
      "train {} --mock-data --train-iters 1 --use-mcore-models --transformer-impl local "
      "--distributed-backend nccl --DDP-impl local --no-masked-softmax-fusion --tensorboard-dir tb "
      "--tokenizer-model tokenizer.model --num-workers 2 --use-mcore-models",
      kTinyModel));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(occurrences(r.out, "no effect here"), 1) << r.out;
  const std::string line = r.out.substr(r.out.find("no effect here: "));
  const std::string first = line.substr(0, line.find('\n'));
  for (const char* flag :
       {"--use-mcore-models", "--transformer-impl", "--distributed-backend", "--DDP-impl",
        "--no-masked-softmax-fusion", "--tensorboard-dir", "--tokenizer-model", "--num-workers"})
    EXPECT_EQ(occurrences(first, std::string(flag) + ","),
              flag == std::string("--num-workers") ? 0 : 1)
        << flag << " in " << first;
  EXPECT_TRUE(has(first, "--num-workers (docs/flags.md says why)")) << first;
}

TEST(CliFlags, EveryUnknownAndRefusedFlagIsReportedAtOnceWithCloseSuggestionsOnly) {
  const Result r = weave(
      fmt::format("train {} --mock-data --num-layer 3 --fp8-format e4m3 --lr-warmup-fraction 0.01 "
                  "--moe-router-fusion --expert-tensr-parallel-size 2 --frobnicate",
                  kTinyModel));
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "6 flags of `weave train`")) << r.out;
  EXPECT_TRUE(has(r.out, "unknown flag '--num-layer' (did you mean '--num-layers'?)")) << r.out;
  EXPECT_TRUE(has(r.out,
                  "unknown flag '--expert-tensr-parallel-size' (did you mean "
                  "'--expert-tensor-parallel-size'?)"))
      << r.out;
  EXPECT_TRUE(has(r.out, "--fp8-format is refused: weave trains fp32, bf16")) << r.out;
  EXPECT_TRUE(has(r.out, "--lr-warmup-fraction is refused")) << r.out;
  // Not a typo of anything: no misleading guess.
  EXPECT_TRUE(has(r.out, "unknown flag '--moe-router-fusion'\n")) << r.out;
  EXPECT_TRUE(has(r.out, "unknown flag '--frobnicate'")) << r.out;
  EXPECT_FALSE(has(r.out, "weave train: ")) << r.out;  // the run's first line
}

// --bf16 and --fp16 train (16-bit mixed precision); an fp16 run shows its loss scale and skipped
// iterations (an initial scale of 2^40 overflows the first steps).
TEST(CliFlags, HalfPrecisionTrainsInBf16AndFp16) {
  const Result fp16 = weave(
      fmt::format("train {} --mock-data --fp16 --train-iters 3 --initial-loss-scale 1099511627776",
                  kTinyModel));
  EXPECT_EQ(fp16.status, 0) << fp16.out;
  EXPECT_TRUE(has(fp16.out, "loss scale 1099511627776.0 | skipped 1")) << fp16.out;
  EXPECT_TRUE(has(fp16.out, "loss scale 549755813888.0 | skipped 3")) << fp16.out;
  // A skipped step's line has no grad norm (Megatron-LM prints none for it), not a NaN.
  const std::size_t first = fp16.out.find("iteration      1/3");
  ASSERT_NE(first, std::string::npos) << fp16.out;
  const std::string line = fp16.out.substr(first, fp16.out.find('\n', first) - first);
  EXPECT_TRUE(has(line, "skipped 1")) << line;
  EXPECT_FALSE(has(line, "grad norm")) << line;
  EXPECT_FALSE(has(fp16.out, "nan")) << fp16.out;
  const Result bf16 = weave(fmt::format("train {} --mock-data --bf16 --train-iters 2", kTinyModel));
  EXPECT_EQ(bf16.status, 0) << bf16.out;
  EXPECT_TRUE(has(bf16.out, "bf16 mixed precision |")) << bf16.out;
  // Pipeline and data parallelism with the distributed optimizer, full recomputation and
  // --qk-layernorm train in bf16 too.
  const Result pp2 = weave(fmt::format(
      "train {} --mock-data --bf16 --train-iters 2 --devices 4 --pipeline-model-parallel-size 2 "
      "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
      "--recompute-num-layers 1 --qk-layernorm --global-batch-size 8",
      kTinyModel));
  EXPECT_EQ(pp2.status, 0) << pp2.out;
  EXPECT_TRUE(has(pp2.out, "bf16 mixed precision |")) << pp2.out;
  EXPECT_TRUE(has(pp2.out, "iteration      2/2")) << pp2.out;
  const Result cp2 = weave(fmt::format(
      "train {} --mock-data --bf16 --train-iters 2 --devices 2 --context-parallel-size 2",
      kTinyModel));
  EXPECT_EQ(cp2.status, 0) << cp2.out;
  EXPECT_TRUE(has(cp2.out, "bf16 mixed precision |")) << cp2.out;
  // fp16 trains with context parallelism and MoE layers too, its loss scaler scaling the aux loss.
  const Result fp16_moe = weave(fmt::format(
      "train {} --mock-data --fp16 --train-iters 2 --devices 2 --context-parallel-size 2 "
      "--num-experts 4",
      kTinyModel));
  EXPECT_EQ(fp16_moe.status, 0) << fp16_moe.out;
  EXPECT_TRUE(has(fp16_moe.out, "fp16 mixed precision |")) << fp16_moe.out;
  EXPECT_TRUE(has(fp16_moe.out, "iteration      2/2")) << fp16_moe.out;
}

TEST(CliFlags, AOneDashLongFlagIsRefusedNamingTheTwoDashForm) {
  const Result r = weave("train -hidden-size 64 --mock-data");
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, "'-hidden-size' has one dash: long flags take two, '--hidden-size'"))
      << r.out;
  EXPECT_FALSE(has(r.out, "Usage:")) << r.out;
  // A negative value is a value, not a flag.
  const Result negative =
      weave(fmt::format("train {} --mock-data --moe-aux-loss-coeff -0.5", kTinyModel));
  EXPECT_TRUE(has(negative.out, "--moe-aux-loss-coeff must be >= 0, got -0.5")) << negative.out;
}

TEST(CliFlags, AMisspeltCommandIsNamedWithTheRightOne) {
  const Result r = weave("trian --mock-data");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "unknown command 'trian' (did you mean 'train'?)")) << r.out;
  EXPECT_TRUE(has(r.out, "topo, simulate, train, schedule")) << r.out;
}

// The options of a --help text that have no description: CLI11 starts it at column 30, on the
// option's line or, when the name reaches that column, on the next.
std::vector<std::string> undescribed(const std::string& help) {
  std::vector<std::string> lines;
  std::istringstream in(help);
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  std::vector<std::string> out;
  constexpr std::size_t kColumn = 30;
  const auto described_at_column = [&](const std::string& l) {
    return l.size() > kColumn && l[kColumn - 1] == ' ' && l[kColumn] != ' ';
  };
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (l.rfind("  -", 0) != 0) continue;
    const bool next_line = i + 1 < lines.size() &&
                           lines[i + 1].rfind(std::string(kColumn, ' '), 0) == 0 &&
                           described_at_column(lines[i + 1]);
    if (!described_at_column(l) && !next_line) out.push_back(l);
  }
  return out;
}

TEST(CliHelp, EveryOptionIsDescribedWithAnExampleAndTheProgramsName) {
  for (const char* command : {"train", "schedule", "simulate", "topo"}) {
    const Result r = weave(fmt::format("{} --help", command));
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_TRUE(has(r.out, fmt::format("Usage: weave {} [OPTIONS]", command))) << r.out;
    EXPECT_TRUE(has(r.out, fmt::format("Example:\n  weave {} ", command))) << r.out;
    EXPECT_GT(occurrences(r.out, "\n  --"), 3) << r.out;
    for (const std::string& line : undescribed(r.out))
      ADD_FAILURE() << "weave " << command << ": no description: " << line;
  }
  // The check itself: one option without a description, two with.
  EXPECT_EQ(undescribed("  --x INT=1\n  --y                         Why\n  --a-very-long-flag-name "
                        "INT=1\n                              Why\n")
                .size(),
            1u);
}

// ------------------------------------------------------- nothing claimed that did not happen

TEST(CliOutputs, EveryOutputPathIsCheckedBeforeAnyWork) {
  const auto missing = scratch("no-such-folder") / "out";
  const std::vector<std::string> train_outputs{"--save", "--trace", "--dump-graph", "--log-json"};
  for (const std::string& flag : train_outputs) {
    const Result r = weave(fmt::format("train {} --mock-data --train-iters 2 {} {}", kTinyModel,
                                       flag, missing.string()));
    EXPECT_NE(r.status, 0) << flag;
    EXPECT_TRUE(has(r.out, fmt::format("{} '{}': the folder '{}' does not exist", flag,
                                       missing.string(), missing.parent_path().string())))
        << r.out;
    EXPECT_FALSE(has(r.out, "iteration")) << flag << ": trained before refusing\n" << r.out;
  }
  for (const char* flag : {"--svg", "--csv", "--trace"}) {
    const Result r =
        weave(fmt::format("schedule --pipeline-model-parallel-size 2 --num-micro-batches 2 {} {}",
                          flag, missing.string()));
    EXPECT_NE(r.status, 0) << flag;
    EXPECT_TRUE(has(r.out, "does not exist")) << r.out;
    EXPECT_FALSE(has(r.out, "makespan")) << flag << ": worked before refusing\n" << r.out;
  }
  for (const char* flag : {"--trace", "--dump-graph"}) {
    const Result r =
        weave(fmt::format("simulate --devices 2 --timing model {} {}", flag, missing.string()));
    EXPECT_NE(r.status, 0) << flag;
    EXPECT_TRUE(has(r.out, "does not exist")) << r.out;
    EXPECT_FALSE(has(r.out, "makespan")) << flag << ": worked before refusing\n" << r.out;
  }
  EXPECT_FALSE(std::filesystem::exists(missing.parent_path()));
}

TEST(CliOutputs, SavingOntoAFolderIsRefusedUpFrontLeavingNothing) {
  const auto folder = scratch("a-folder");
  std::filesystem::create_directories(folder);
  const Result r = weave(
      fmt::format("train {} --mock-data --train-iters 2 --save {}", kTinyModel, folder.string()));
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, fmt::format("--save '{}' is a folder", folder.string()))) << r.out;
  EXPECT_FALSE(has(r.out, "iteration")) << r.out;
  EXPECT_FALSE(std::filesystem::exists(folder.string() + ".partial"));
  EXPECT_TRUE(std::filesystem::is_empty(folder));
}

TEST(CliOutputs, ATraceIterationBeyondTheRunIsRefusedUpFront) {
  const auto trace = scratch("never.json");
  Result r =
      weave(fmt::format("train {} --mock-data --train-iters 3 --trace {} --trace-iteration 10",
                        kTinyModel, trace.string()));
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(
      has(r.out, "--trace-iteration 10 is beyond the run's last iteration, --train-iters 3"))
      << r.out;
  EXPECT_FALSE(std::filesystem::exists(trace));
  // A run shorter than the default trace iteration traces its last one, and says so truly.
  r = weave(
      fmt::format("train {} --mock-data --train-iters 1 --trace {}", kTinyModel, trace.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, fmt::format("trace of iteration 1: {}", trace.string()))) << r.out;
  EXPECT_TRUE(std::filesystem::exists(trace));
}

TEST(CliOutputs, SimulateNamesTheTraceFilesItWrites) {
  const auto trace = scratch("sim.json");
  const Result r = weave(fmt::format(
      "simulate --devices 2 --layers 1 --chunks 1 --timing both --iterations 1 --trace {}",
      trace.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto wall = trace.parent_path() / "sim.wall.json",
             model = trace.parent_path() / "sim.model.json";
  EXPECT_TRUE(has(r.out, fmt::format("trace: {}, {}\n", wall.string(), model.string()))) << r.out;
  EXPECT_TRUE(std::filesystem::exists(wall));
  EXPECT_TRUE(std::filesystem::exists(model));
  EXPECT_FALSE(std::filesystem::exists(trace));
}

TEST(CliOutputs, ARunBeyondTheHostsMemoryIsRefusedWithTheEstimate) {
  const Result r = weave("train --mock-data --hidden-size 100000 --num-attention-heads 4");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, "the run needs about")) << r.out;
  EXPECT_TRUE(has(r.out, "more than this host's")) << r.out;
  EXPECT_TRUE(has(r.out, "GiB per device at most (parameters")) << r.out;
  EXPECT_FALSE(has(r.out, "bad_alloc")) << r.out;
  // A run that fits shows its estimate.
  const Result fits = weave(fmt::format("train {} --mock-data --train-iters 1", kTinyModel));
  ASSERT_EQ(fits.status, 0) << fits.out;
  EXPECT_TRUE(has(fits.out, "memory (estimate): ")) << fits.out;
  EXPECT_TRUE(has(fits.out, "per device at most (parameters ")) << fits.out;
}

TEST(CliOutputs, OptionValuesAreValidatedBeforeTheRun) {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"--adam-beta1 2", "--adam-beta1 must be in [0, 1), got 2"},
      {"--adam-beta2 1", "--adam-beta2 must be in [0, 1), got 1"},
      {"--adam-eps 0", "--adam-eps must be a finite number > 0, got 0"},
      {"--moe-aux-loss-coeff -0.1", "--moe-aux-loss-coeff must be >= 0, got -0.1"},
      {"--moe-z-loss-coeff -1", "--moe-z-loss-coeff must be >= 0, got -1"},
      {"--save-interval -1", "--save-interval: must be a whole number of at least 0 (got '-1')"},
      {"--split 0,5,5", "--split '0,5,5' leaves nothing to train on"},
      {"--optimizer sgd", "--optimizer"},
  };
  for (const auto& [flags, message] : cases) {
    const Result r =
        weave(fmt::format("train {} --mock-data --train-iters 2 {}", kTinyModel, flags));
    EXPECT_NE(r.status, 0) << flags;
    EXPECT_TRUE(has(r.out, message)) << r.out;
    EXPECT_FALSE(has(r.out, "iteration ")) << flags << ": trained before refusing\n" << r.out;
  }
}

TEST(CliOutputs, BinaryDataIsRefusedNamingTheFileAndWhatWasFound) {
  Result r = weave(fmt::format("train {} --data-path {}", kTinyModel, WEAVE_BINARY));
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, fmt::format("--data-path '{}' is an ELF binary", WEAVE_BINARY))) << r.out;
  const auto folder = scratch("mixed-data");
  std::filesystem::create_directories(folder);
  std::ofstream(folder / "a.txt") << std::string(4000, 'a');
  std::ofstream(folder / "b.bin", std::ios::binary) << std::string("text\0with a NUL", 16);
  r = weave(fmt::format("train {} --data-path {}", kTinyModel, folder.string()));
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(has(r.out, fmt::format("'{}' holds NUL bytes (the first at byte 4)",
                                     (folder / "b.bin").string())))
      << r.out;
}

TEST(CliSchedule, ALargeScheduleIsCutSayingSo) {
  const Result r = weave("schedule -p 32 -m 1000");
  ASSERT_EQ(r.status, 0) << r.out.substr(0, 2000);
  EXPECT_LT(r.out.size(), 20000u);
  EXPECT_TRUE(has(r.out,
                  "(order shown for 16 of 32 ranks, at most 64 actions each; --csv FILE "
                  "writes all of it)"))
      << r.out;
  EXPECT_TRUE(has(r.out, "r0: F0 F1 F2")) << r.out;
  EXPECT_TRUE(has(r.out, " ... (1936 more)\n")) << r.out;
  EXPECT_TRUE(has(r.out, "bubble / ideal: ")) << r.out;
}

// ------------------------------------------------------------------- progress and the log

TEST(CliProgress, TheProgressLineFitsANarrowTerminal) {
  const Result r = weave_on_terminal({"train",
                                      "--num-layers",
                                      "2",
                                      "--hidden-size",
                                      "32",
                                      "--num-attention-heads",
                                      "4",
                                      "--seq-length",
                                      "32",
                                      "--mock-data",
                                      "--train-iters",
                                      "12",
                                      "--log-interval",
                                      "100",
                                      "--devices",
                                      "2",
                                      "--pipeline-model-parallel-size",
                                      "2",
                                      "--global-batch-size",
                                      "2"},
                                     60);
  ASSERT_EQ(r.status, 0) << r.out;
  int progress_lines = 0;
  std::string piece;
  // What one carriage return or line feed to the next draws, the clear-to-end code aside.
  for (std::size_t i = 0; i <= r.out.size(); ++i) {
    if (i == r.out.size() || r.out[i] == '\r' || r.out[i] == '\n') {
      if (piece.rfind("iter ", 0) == 0) {
        ++progress_lines;
        EXPECT_LE(piece.size(), 59u) << piece;
      }
      piece.clear();
    } else if (r.out.compare(i, 3, "\033[K") == 0) {
      i += 2;
    } else {
      piece += r.out[i];
    }
  }
  EXPECT_GE(progress_lines, 12) << r.out;
}

TEST(CliProgress, TheBubbleIsShownBesideTheSchedulesOwn) {
  // 1F1B on p = 2 with m = 2 micro-batches: (p - 1) / m = 0.5, as `weave schedule` says.
  const Result r = weave(
      "train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --mock-data "
      "--train-iters 2 --log-interval 1 --devices 2 --pipeline-model-parallel-size 2 "
      "--global-batch-size 2");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, "| bubble/ideal ")) << r.out;
  EXPECT_TRUE(has(r.out, " (schedule 0.50)")) << r.out;
  const Result schedule = weave("schedule -p 2 -m 2");
  EXPECT_TRUE(has(schedule.out, "bubble / ideal: 0.500 simulated, 0.500 in theory"))
      << schedule.out;
}

TEST(CliProgress, LogJsonRecordsAreTypedBetweenARunHeaderAndASummary) {
  const auto log = scratch("typed.jsonl");
  const Result r = weave(fmt::format(
      "train {} --mock-data --train-iters 4 --eval-interval 2 --eval-iters 1 --log-json {}",
      kTinyModel, log.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  std::vector<nlohmann::json> records;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);)
    records.push_back(nlohmann::json::parse(line));
  ASSERT_GE(records.size(), 2u);
  EXPECT_EQ(records.front()["type"], "run");
  EXPECT_EQ(records.front()["model"]["hidden_size"], 32);
  EXPECT_EQ(records.front()["model"]["num_layers"], 2);
  EXPECT_EQ(records.front()["plan"]["micro_batch_size"], 2);
  EXPECT_EQ(records.front()["train_iters"], 4);
  EXPECT_EQ(records.front()["learning_rate"]["lr_warmup_iters"], 2);
  EXPECT_EQ(records.back()["type"], "summary");
  EXPECT_EQ(records.back()["iterations"], 4);
  std::map<std::string, int> types;
  for (const auto& j : records)
    ++types[j.at("type").get<std::string>()];
  EXPECT_EQ(types["iteration"], 4);
  EXPECT_EQ(types["validation"], 2);
  EXPECT_EQ(types.size(), 4u);
}

// A one-device run (its arena has a single slot) says nothing of the threading library.
TEST(CliTrain, AOneDeviceRunPrintsNoLibraryWarning) {
  const Result r = weave("train --mock-data --train-iters 2 --devices 1");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.find("TBB"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("arning"), std::string::npos) << r.out;
}

}  // namespace
