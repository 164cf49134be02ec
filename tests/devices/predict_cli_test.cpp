// `weave predict` end to end: a configuration's step predicted without allocating it, devices
// that would run out of memory named, the replay written as a trace.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "run_weave.hpp"

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

TEST(PredictCli, TrainRefusesWhatOnlyPredictModels) {
  for (const char* flag : {"--bf16", "--recompute-granularity full", "--vocab-size 50257"}) {
    const Result r = weave(fmt::format("train --mock-data --train-iters 1 {}", flag));
    EXPECT_NE(r.status, 0) << flag;
    EXPECT_NE(r.out.find("weave predict, which models"), std::string::npos) << r.out;
  }
}

TEST(PredictCli, AnAcceleratorPresetSetsTheMachine) {
  const Result r = weave(std::string(kConfig) + " --accelerator h100-sxm");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("H100-SXM5-80GB (peak 9.894e+14 FLOP/s, 80.00 GiB of memory)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("% of 9.89e+14"), std::string::npos) << r.out;  // MFU against the peak
  EXPECT_NE(r.out.find(", of 80.00 GiB"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace weave::cli_test
