// `weave predict` end to end: a configuration's step predicted without allocating it, devices
// that would run out of memory named, the replay written as a trace.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <set>

#include "run_weave.hpp"
#include "weave/runtime/chrome_trace.hpp"

namespace weave::cli_test {
namespace {

const char* kConfig =
    "predict --num-layers 4 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 1024 "
    "--seq-length 512 --num-experts 8 --moe-layer-freq 2 --devices 8 "
    "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4 "
    "--global-batch-size 8 --device-flops 1e14 --device-memory-bandwidth 1e12 --link nvlink4";

TEST(PredictCli, ReportsTheStepItWouldTake) {
  const std::string trace =
      (std::filesystem::temp_directory_path() / "weave_predict_cli_test.json").string();
  const Result r = weave(std::string(kConfig) + " --trace " + trace);
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* line :
       {"step ", "throughput ", "model FLOPs ", "MFU ", "bubble ", "exposed comm ", "memory "})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  std::smatch mfu;
  ASSERT_TRUE(std::regex_search(r.out, mfu, std::regex("MFU ([0-9.]+) %"))) << r.out;
  EXPECT_GT(std::stod(mfu[1]), 0);
  EXPECT_LT(std::stod(mfu[1]), 100);
  EXPECT_EQ(r.out.find("run out of memory"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::exists(trace));
  std::filesystem::remove(trace);
}

TEST(PredictCli, NamesDevicesThatWouldRunOutOfMemory) {
  const Result r = weave(std::string(kConfig) + " --device-memory 0.01");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("8 of 8 devices would run out of memory"), std::string::npos) << r.out;
}

TEST(PredictCli, RefusesWhatTrainRefuses) {
  const Result r = weave("predict --num-attention-heads 3");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--num-attention-heads (3)"), std::string::npos) << r.out;
}

// Left out, --ffn-hidden-size is Megatron-LM's for the hidden size: 4 h, or 2/3 of it rounded
// down to a multiple of 64 with SwiGLU (4 x 1000 x 2/3 = 2666.7: 2624).
TEST(PredictCli, FfnHiddenSizeLeftOutIsMegatronsForTheHiddenSize) {
  const std::string model =
      "predict --num-layers 2 --hidden-size 1000 --num-attention-heads 8 --seq-length 256 "
      "--num-experts 4 --global-batch-size 2 --device-flops 1e14";
  const Result gelu = weave(model);
  ASSERT_EQ(gelu.status, 0) << gelu.out;
  EXPECT_NE(gelu.out.find("4 experts top-2, 4000 wide"), std::string::npos) << gelu.out;
  const Result swiglu = weave(model + " --swiglu");
  ASSERT_EQ(swiglu.status, 0) << swiglu.out;
  EXPECT_NE(swiglu.out.find("4 experts top-2, 2624 wide"), std::string::npos) << swiglu.out;
  const Result given = weave(model + " --swiglu --ffn-hidden-size 512");
  EXPECT_NE(given.out.find("4 experts top-2, 512 wide"), std::string::npos) << given.out;
}

// DeepSeek-V3's shapes on the command line: a dense first layer by Megatron's pattern, experts
// of their own width; a pattern in another Python form is refused naming the forms read.
TEST(PredictCli, TakesMegatronsMoeLayerPatternAndExpertWidth) {
  const Result r =
      weave(std::string(kConfig) + " --moe-layer-freq '([0]*1+[1]*3)' --moe-ffn-hidden-size 512");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("8 experts top-2, 512 wide, in 3 of 4 layers"), std::string::npos) << r.out;
  const Result other = weave(std::string(kConfig) + " --moe-layer-freq '2*([1]*2+[0]*2)'");
  EXPECT_EQ(other.status, 1) << other.out;
  EXPECT_NE(other.out.find("a sum of bracketed lists and parenthesised sums, each times a count"),
            std::string::npos)
      << other.out;
  const Result short_pattern = weave(std::string(kConfig) + " --moe-layer-freq '[0,1,1]'");
  EXPECT_EQ(short_pattern.status, 1) << short_pattern.out;
  EXPECT_NE(short_pattern.out.find("pattern has 3 entries and --num-layers is 4"),
            std::string::npos)
      << short_pattern.out;
}

// What weave train refuses and weave predict models: 16-bit training, a tokenizer's vocabulary
// and activation recomputation.
TEST(PredictCli, ModelsHalfPrecisionVocabularyAndRecomputation) {
  const Result r =
      weave(std::string(kConfig) +
            " --bf16 --vocab-size 50257 --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 2");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("vocabulary 50257 (padded 50432), bf16, full recomputation (uniform 2)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("with this run's"), std::string::npos) << r.out;
  // The FLOP/s per device also as Megatron-LM's papers count them, the recomputation included:
  // higher than the model FLOP/s by the recomputed forward's share.
  std::smatch rates;
  ASSERT_TRUE(std::regex_search(
      r.out, rates,
      std::regex("per device +([0-9.e+]+) FLOP/s of model math.*; ([0-9.e+]+) FLOP/s, "
                 "[0-9.]+ % counting the recomputed forward")))
      << r.out;
  EXPECT_GT(std::stod(rates[2]), std::stod(rates[1]));
  EXPECT_LT(std::stod(rates[2]), 4.0 / 3 * std::stod(rates[1]) * 1.0001);
  // Selective recomputation of the MLPs adds their forward to this run's FLOPs; core_attn alone
  // adds nothing (the blockwise attention recomputes its scores anyway).
  const Result mlp =
      weave(std::string(kConfig) + " --recompute-granularity selective --recompute-modules mlp");
  ASSERT_EQ(mlp.status, 0) << mlp.out;
  EXPECT_NE(mlp.out.find("selective recomputation of the MLPs"), std::string::npos) << mlp.out;
  EXPECT_NE(mlp.out.find("with this run's"), std::string::npos) << mlp.out;
  // The norms and the experts' activation run no product again: named, no FLOPs added; a MoE
  // layer recomputed whole adds its router's and experts' products.
  const Result light = weave(std::string(kConfig) +
                             " --recompute-granularity selective --recompute-modules layernorm "
                             "moe_act");
  ASSERT_EQ(light.status, 0) << light.out;
  EXPECT_NE(light.out.find("selective recomputation of the experts' activations, the norms"),
            std::string::npos)
      << light.out;
  EXPECT_EQ(light.out.find("with this run's"), std::string::npos) << light.out;
  const Result moe =
      weave(std::string(kConfig) + " --recompute-granularity selective --recompute-modules moe");
  ASSERT_EQ(moe.status, 0) << moe.out;
  EXPECT_NE(moe.out.find("selective recomputation of the MoE layers"), std::string::npos)
      << moe.out;
  EXPECT_NE(moe.out.find("with this run's"), std::string::npos) << moe.out;
  const Result core = weave(std::string(kConfig) + " --recompute-activations");
  ASSERT_EQ(core.status, 0) << core.out;
  EXPECT_EQ(core.out.find("with this run's"), std::string::npos) << core.out;
  const Result both = weave(std::string(kConfig) + " --bf16 --fp16");
  EXPECT_NE(both.status, 0);
  EXPECT_NE(both.out.find("--bf16 and --fp16 are two precisions: give one"), std::string::npos)
      << both.out;
  const Result method = weave(std::string(kConfig) + " --recompute-granularity full");
  EXPECT_NE(method.status, 0);
  EXPECT_NE(method.out.find("needs --recompute-method uniform or block (Megatron-LM's rule)"),
            std::string::npos)
      << method.out;
  // fp8 is neither what weave trains nor what it predicts.
  const Result fp8 = weave(std::string(kConfig) + " --fp8-format hybrid");
  EXPECT_NE(fp8.status, 0);
  EXPECT_NE(fp8.out.find("--fp8-format is refused"), std::string::npos) << fp8.out;
}

// fp16 under ZeRO stages 2 and 3, once only predicted, trains: the default initial scale of 2^32
// overflows the first step, which every replica skips (fp16_training_test.cpp compares the
// stages with plain data parallelism).
TEST(PredictCli, TrainsFp16UnderZeroStagesTwoAndThree) {
  for (const char* stage : {"2", "3"}) {
    const Result r = weave(
        std::string("train --mock-data --train-iters 1 --fp16 --devices 2 --zero-stage ") + stage);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("| loss scale 4294967296.0 | skipped 1"), std::string::npos) << r.out;
  }
}

// Megatron-LM reads --vocab-size for its NullTokenizer only: beside a tokenizer that gives the
// vocabulary, as every one of weave's does, a script's --vocab-size changes nothing in training;
// a prediction models a vocabulary of that size.
TEST(PredictCli, VocabularySizeHasNoEffectInTrainingAndSizesAPrediction) {
  const Result trained = weave("train --mock-data --train-iters 1 --vocab-size 50257");
  ASSERT_EQ(trained.status, 0) << trained.out;
  EXPECT_NE(trained.out.find("no effect here: --vocab-size"), std::string::npos) << trained.out;
  // The output layer: 6 x tokens x hidden x padded vocabulary FLOPs a step (forward and
  // backward), the vocabulary padded to 128 x tp = 256: 1,024 and 256,000 columns.
  const auto flops = [](const std::string& vocab) {
    const Result r = weave(std::string(kConfig) + " --vocab-size " + vocab);
    EXPECT_EQ(r.status, 0) << r.out;
    std::smatch m;
    EXPECT_TRUE(std::regex_search(r.out, m, std::regex(R"(model FLOPs +([0-9.e+]+) a step)")))
        << r.out;
    return m.empty() ? 0.0 : std::stod(m[1]);
  };
  // (printed to four digits: 1.605e+12 within 5e+8 either way)
  EXPECT_NEAR(flops("256000") - flops("1000"), 6.0 * 8 * 512 * 256 * (256000 - 1024), 1e9);
}

// weave train recomputes layers in full, MLPs and norms selectively: the losses are those of the
// run keeping every activation, and the memory estimate holds fewer activations; what is not
// done is refused by name.
TEST(PredictCli, TrainRecomputesLayersInFull) {
  const std::string run =
      "train --mock-data --train-iters 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
      "--seq-length 64 --micro-batch-size 2 --global-batch-size 4 --hidden-dropout 0.1 "
      "--tensor-model-parallel-size 2 --sequence-parallel --devices 2";
  const Result kept = weave(run);
  const Result recomputed = weave(run +
                                  " --recompute-granularity full --recompute-method uniform "
                                  "--recompute-num-layers 1");
  ASSERT_EQ(kept.status, 0) << kept.out;
  ASSERT_EQ(recomputed.status, 0) << recomputed.out;
  const std::regex done("done: loss ([0-9.]+) -> ([0-9.]+)"),
      activations("activations ([0-9.]+) (KiB|MiB)");
  std::smatch a, b;
  ASSERT_TRUE(std::regex_search(kept.out, a, done)) << kept.out;
  ASSERT_TRUE(std::regex_search(recomputed.out, b, done)) << recomputed.out;
  EXPECT_EQ(a.str(), b.str());
  ASSERT_TRUE(std::regex_search(kept.out, a, activations)) << kept.out;
  ASSERT_TRUE(std::regex_search(recomputed.out, b, activations)) << recomputed.out;
  EXPECT_EQ(a[2], "MiB");
  EXPECT_LT(std::stod(b[1]), std::stod(a[1]));
  const Result mlp = weave(run + " --recompute-activations --recompute-modules core_attn mlp");
  ASSERT_EQ(mlp.status, 0) << mlp.out;
  ASSERT_TRUE(std::regex_search(kept.out, a, done)) << kept.out;
  ASSERT_TRUE(std::regex_search(mlp.out, b, done)) << mlp.out;
  EXPECT_EQ(a.str(), b.str());
  ASSERT_TRUE(std::regex_search(kept.out, a, activations)) << kept.out;
  ASSERT_TRUE(std::regex_search(mlp.out, b, activations)) << mlp.out;
  EXPECT_LT(std::stod(b[1]), std::stod(a[1]));
  const Result norms =
      weave(run + " --recompute-granularity selective --recompute-modules layernorm");
  ASSERT_EQ(norms.status, 0) << norms.out;
  ASSERT_TRUE(std::regex_search(kept.out, a, done)) << kept.out;
  ASSERT_TRUE(std::regex_search(norms.out, b, done)) << norms.out;
  EXPECT_EQ(a.str(), b.str());
  ASSERT_TRUE(std::regex_search(kept.out, a, activations)) << kept.out;
  ASSERT_TRUE(std::regex_search(norms.out, b, activations)) << norms.out;
  EXPECT_LT(std::stod(b[1]), std::stod(a[1]));
  const Result zero_bubble = weave(
      "train --mock-data --train-iters 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
      "--seq-length 64 --micro-batch-size 1 --global-batch-size 4 --pipeline-model-parallel-size 2 "
      "--pipeline-scheduler zb-h1 --devices 2 --recompute-granularity selective "
      "--recompute-modules layernorm");
  EXPECT_NE(zero_bubble.status, 0);
  EXPECT_NE(zero_bubble.out.find(
                "--recompute-modules layernorm is not done with --pipeline-scheduler zb-h1"),
            std::string::npos)
      << zero_bubble.out;
}

TEST(PredictCli, AnAcceleratorPresetSetsTheMachine) {
  const Result r = weave(std::string(kConfig) + " --accelerator h100-sxm");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("H100-SXM5-80GB (peak 9.894e+14 FLOP/s, 80.00 GiB of memory)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("% of 9.89e+14"), std::string::npos) << r.out;  // MFU against the peak
  EXPECT_NE(r.out.find(", of 80.00 GiB"), std::string::npos) << r.out;
  // The preset's kernel model at the power-limited clock (0.849): products by shape (850 TFLOP/s
  // measured), attention at the measured rate of the backend's kernel (flash: FlashAttention-2,
  // 191 TFLOP/s at a 512 sequence).
  EXPECT_NE(r.out.find("matrix products 7.22e+14 FLOP/s (half that at 134 rows), attention "
                       "1.62e+14 FLOP/s"),
            std::string::npos)
      << r.out;
}

// --trace-ranks writes the replay of the ranks asked for, and refuses what it cannot write.
TEST(PredictCli, TraceRanksWritesTheChosenRanksOnly) {
  const std::string trace =
      (std::filesystem::temp_directory_path() / "weave_predict_trace_ranks.json").string();
  // 8 devices: tp 2, dp 4 (ep 4 folds over dp); ranks 0 and 1 are replica 0's.
  const Result r = weave(std::string(kConfig) + " --trace " + trace + " --trace-ranks 0-1");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("trace of the replay of 2 rank(s) (0-1)"), std::string::npos) << r.out;
  const rt::Trace t = rt::read_chrome_trace(trace);
  std::set<rt::DeviceId> devices;
  for (const rt::Span& s : t.spans())
    devices.insert(t.tasks()[s.task].device);
  EXPECT_EQ(devices, (std::set<rt::DeviceId>{0, 1}));
  std::filesystem::remove(trace);
  const Result folded = weave(std::string(kConfig) + " --trace " + trace + " --trace-ranks 0,5");
  EXPECT_NE(folded.status, 0);
  EXPECT_NE(folded.out.find("rank 5 is data-parallel replica 2's, folded into replica 0 (the same "
                            "program on other samples): trace rank 1 instead, or add --every-rank"),
            std::string::npos)
      << folded.out;
  EXPECT_FALSE(std::filesystem::exists(trace));
  const Result every =
      weave(std::string(kConfig) + " --every-rank --trace " + trace + " --trace-ranks 5");
  EXPECT_EQ(every.status, 0) << every.out;
  std::filesystem::remove(trace);
  const Result range = weave(std::string(kConfig) + " --trace " + trace + " --trace-ranks 3-9");
  EXPECT_NE(range.out.find("--trace-ranks takes ranks in [0, 8) and ranges like 0-7,64; '9' is "
                           "not one"),
            std::string::npos)
      << range.out;
  const Result alone = weave(std::string(kConfig) + " --trace-ranks 0");
  EXPECT_NE(alone.out.find("--trace-ranks 0 chooses what --trace writes: add --trace FILE"),
            std::string::npos)
      << alone.out;
}

// weave calibrate writes a preset of this host's rates that weave predict then reads.
TEST(PredictCli, CalibrateWritesAHostPresetPredictReads) {
  const std::string preset =
      (std::filesystem::temp_directory_path() / "weave_calibrate_cli_test.json").string();
  const Result r = weave("calibrate --devices 2 --seconds 0.002 --output " + preset);
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* kernel : {"matmul ", "attention ", "streaming "})
    EXPECT_NE(r.out.find(kernel), std::string::npos) << kernel << "\n" << r.out;
  const Result p = weave(
      "predict --num-layers 2 --hidden-size 64 --num-attention-heads 4 --devices 2 "
      "--tensor-model-parallel-size 2 --accelerator " +
      preset);
  ASSERT_EQ(p.status, 0) << p.out;
  EXPECT_NE(p.out.find("this host, 2 device(s)"), std::string::npos) << p.out;
  std::filesystem::remove(preset);
  const Result bad = weave("calibrate --devices 0 --output " + preset);
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("--devices"), std::string::npos) << bad.out;
  const Result nowhere = weave("calibrate --output /nonexistent-folder/host.json");
  EXPECT_NE(nowhere.status, 0);
  EXPECT_NE(nowhere.out.find("--output"), std::string::npos) << nowhere.out;
  EXPECT_FALSE(std::filesystem::exists(preset));
}

TEST(PredictCli, PrintsTheClusterItModelled) {
  const Result preset = weave(std::string(kConfig) + " --accelerator h100-sxm");
  ASSERT_EQ(preset.status, 0) << preset.out;
  // Its links at the bus bandwidth collectives reach, the line rate's share named.
  EXPECT_NE(preset.out.find("cluster          1 node x 8 devices (8 used); node link NVLink 4 "
                            "(NVSwitch), 80 % of its 450 GB/s as bus bandwidth (360 GB/s, 3 us); "
                            "network InfiniBand NDR"),
            std::string::npos)
      << preset.out;
  const Result custom =
      weave(std::string(kConfig) + " --devices-per-node 2 --node-link 450:3 --network 25:10");
  ASSERT_EQ(custom.status, 0) << custom.out;
  EXPECT_NE(custom.out.find("cluster          4 nodes x 2 devices (8 used); node link 450:3 (450 "
                            "GB/s, 3 us); network 25:10 (25 GB/s, 10 us) a device"),
            std::string::npos)
      << custom.out;
  // Without a cluster flag nothing is said of one.
  const Result none = weave(kConfig);
  ASSERT_EQ(none.status, 0) << none.out;
  EXPECT_EQ(none.out.find("cluster "), std::string::npos) << none.out;
}

TEST(PredictCli, RefusesAClusterFlagOutsideItsRule) {
  const std::pair<const char*, const char*> cases[] = {
      {" --accelerator h100-sxm --network 50", "--network '50': a link is GBPS:MICROSECONDS"},
      {" --accelerator h100-sxm --node-link -1:3", "--node-link '-1:3': a link is"},
      {" --accelerator h100-sxm --devices-per-node 2000000",
       "--devices-per-node must be a whole number from 1 to 1000000 (got 2000000)"},
      {" --devices-per-node 0", "must be a whole number of at least 1 (got '0')"},
      {" --devices-per-node 4 --node-link 450:3",
       "a cluster without --accelerator needs --devices-per-node, --node-link and --network "
       "(missing --network)"},
  };
  for (const auto& [flags, expected] : cases) {
    const Result r = weave(std::string(kConfig) + flags);
    EXPECT_NE(r.status, 0) << flags << "\n" << r.out;
    EXPECT_NE(r.out.find(expected), std::string::npos) << flags << "\n" << r.out;
  }
}

}  // namespace
}  // namespace weave::cli_test
