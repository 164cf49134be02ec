// `weave predict` end to end: a configuration's step predicted without allocating it, devices
// that would run out of memory named, the replay written as a trace.
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

TEST(PredictCli, AnAcceleratorPresetSetsTheMachine) {
  const Result r = weave(std::string(kConfig) + " --accelerator h100-sxm");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("H100-SXM5-80GB (peak 9.894e+14 FLOP/s, 80.00 GiB of memory)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("% of 9.89e+14"), std::string::npos) << r.out;  // MFU against the peak
  EXPECT_NE(r.out.find(", of 80.00 GiB"), std::string::npos) << r.out;
  // The preset's kernel model: products by shape, attention at its own rate.
  EXPECT_NE(r.out.find("matrix products 7.42e+14 FLOP/s (half that at 128 rows), attention "
                       "5.44e+14 FLOP/s"),
            std::string::npos)
      << r.out;
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

}  // namespace
}  // namespace weave::cli_test
