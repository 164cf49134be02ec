// Accelerator presets as data: every preset loads with its published figures and its sources; a
// user's file loads; a wrong one is refused naming the field.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "weave/devices/accelerator.hpp"

namespace weave::devices {
namespace {

TEST(Accelerator, PresetsHoldTheirPublishedFiguresAndSources) {
  const std::vector<std::string> names = Accelerator::preset_names();
  EXPECT_EQ(names, (std::vector<std::string>{"a100-80gb", "ascend-910b", "h100-sxm"}));
  for (const std::string& name : names) {
    const Accelerator a = Accelerator::load(name);
    EXPECT_FALSE(a.sources.empty()) << name;
    EXPECT_FALSE(a.assumed.empty()) << name;
    EXPECT_LT(a.sustained_flops(), a.peak_flops) << name;
    EXPECT_GT(a.node_link.bytes_per_second, a.network.bytes_per_second) << name;
    EXPECT_EQ(a.devices_per_node, 8) << name;
  }
  const Accelerator a100 = Accelerator::load("a100-80gb"), h100 = Accelerator::load("h100-sxm");
  EXPECT_DOUBLE_EQ(a100.peak_flops, 312e12);
  EXPECT_DOUBLE_EQ(a100.memory_bandwidth, 2.039e12);
  EXPECT_EQ(a100.memory_bytes, std::int64_t{80} << 30);
  EXPECT_DOUBLE_EQ(h100.peak_flops, 989.4e12);
  EXPECT_DOUBLE_EQ(h100.memory_bandwidth, 3.35e12);
  EXPECT_DOUBLE_EQ(Accelerator::load("ascend-910b").memory_bandwidth, 1.6e12);
}

TEST(Accelerator, AUsersFileLoadsAndAWrongOneIsNamed) {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string good = (dir / "weave_accelerator_test.json").string();
  std::ofstream(good) << R"({"name": "mine", "peak_flops": 1e15, "matmul_efficiency": 0.5,
    "memory_bytes": 1e11, "memory_bandwidth": 4e12, "memory_efficiency": 1, "devices_per_node": 4,
    "node_link": {"bytes_per_second": 1e11, "latency_us": 1},
    "network": {"bytes_per_second": 1e10, "latency_us": 4}})";
  const Accelerator a = Accelerator::load(good);
  EXPECT_EQ(a.name, "mine");
  EXPECT_DOUBLE_EQ(a.sustained_flops(), 5e14);
  EXPECT_EQ(a.devices_per_node, 4);
  std::ofstream(good) << R"({"name": "bad", "peak_flops": 1e15, "matmul_efficiency": 1.5})";
  try {
    Accelerator::load(good);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'matmul_efficiency' is a share of the peak, in (0, 1]"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove(good);
  try {
    Accelerator::load("tpu-v9");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("a100-80gb, ascend-910b, h100-sxm"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(Accelerator::load("no/such/file.json"), std::invalid_argument);
}

}  // namespace
}  // namespace weave::devices
