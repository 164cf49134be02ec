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
  const Accelerator ascend = Accelerator::load("ascend-910b");
  EXPECT_DOUBLE_EQ(ascend.memory_bandwidth, 1.6e12);
  // The Atlas 800T A2's chips are a full mesh of HCCS links, one link's rate given; switched
  // nodes give a device's share.
  EXPECT_TRUE(ascend.node_link.full_mesh);
  EXPECT_DOUBLE_EQ(ascend.node_link.bytes_per_second, 56e9);
  EXPECT_FALSE(a100.node_link.full_mesh);
  EXPECT_FALSE(h100.node_link.full_mesh);
  // The kernel model's figures, each stated with its source or as an assumption.
  EXPECT_DOUBLE_EQ(a100.attention_efficiency, 0.6);
  EXPECT_DOUBLE_EQ(a100.matmul_overhead_dimension, 128);
  EXPECT_DOUBLE_EQ(h100.attention_efficiency, 0.55);
  EXPECT_NE(a100.assumed.find("attention_efficiency"), std::string::npos);
  // The launch cost and the links' bus efficiencies, each figure's source beside it.
  for (const Accelerator* a : {&a100, &h100}) {
    EXPECT_DOUBLE_EQ(a->kernel_launch_us, 1);
    EXPECT_GT(a->node_link.bus_efficiency, 0.5);
    EXPECT_LT(a->node_link.bus_efficiency, 1);
    EXPECT_LT(a->network.bus_efficiency, 1);
    for (const char* field :
         {"peak_flops", "matmul_efficiency", "attention_efficiency", "memory_bandwidth",
          "kernel_launch_us", "node_link.bus_efficiency", "network.bus_efficiency"}) {
      bool found = false;
      for (const auto& [name, text] : a->figure_sources)
        found = found || (name == field && !text.empty());
      EXPECT_TRUE(found) << a->name << " gives no source for " << field;
    }
  }
}

// A preset written by to_json (weave calibrate's) reads back as the same accelerator.
TEST(Accelerator, ToJsonReadsBackTheSame) {
  Accelerator a = Accelerator::load("h100-sxm");
  a.name = "copy";
  a.matmul_overhead_dimension = 37.5;
  const Accelerator b = Accelerator::parse(a.to_json(), "a copy");
  EXPECT_EQ(b.name, "copy");
  EXPECT_DOUBLE_EQ(b.peak_flops, a.peak_flops);
  EXPECT_DOUBLE_EQ(b.matmul_efficiency, a.matmul_efficiency);
  EXPECT_DOUBLE_EQ(b.matmul_overhead_dimension, 37.5);
  EXPECT_DOUBLE_EQ(b.attention_efficiency, a.attention_efficiency);
  EXPECT_DOUBLE_EQ(b.attention_backward_efficiency, a.attention_efficiency);  // absent: the same
  EXPECT_EQ(b.memory_bytes, a.memory_bytes);
  EXPECT_DOUBLE_EQ(b.memory_bandwidth, a.memory_bandwidth);
  EXPECT_DOUBLE_EQ(b.memory_efficiency, a.memory_efficiency);
  EXPECT_EQ(b.devices_per_node, a.devices_per_node);
  EXPECT_EQ(b.node_link.name, a.node_link.name);
  EXPECT_DOUBLE_EQ(b.network.bytes_per_second, a.network.bytes_per_second);
  EXPECT_DOUBLE_EQ(b.kernel_launch_us, a.kernel_launch_us);
  EXPECT_DOUBLE_EQ(b.node_link.bus_efficiency, a.node_link.bus_efficiency);
  EXPECT_DOUBLE_EQ(b.network.bus_efficiency, a.network.bus_efficiency);
  EXPECT_FALSE(b.node_link.full_mesh);
  Accelerator mesh = Accelerator::load("ascend-910b");
  EXPECT_TRUE(Accelerator::parse(mesh.to_json(), "a mesh copy").node_link.full_mesh);
  EXPECT_EQ(b.sources, a.sources);
  EXPECT_EQ(b.figure_sources, a.figure_sources);
  EXPECT_EQ(b.assumed, a.assumed);
  // The measured attention kernels and the power-limited clock read back the same.
  EXPECT_DOUBLE_EQ(b.power_limited_clock_share, a.power_limited_clock_share);
  EXPECT_EQ(b.attention_auto, a.attention_auto);
  ASSERT_EQ(b.attention_kernels.size(), a.attention_kernels.size());
  for (const char* backend : {"flash", "fused", "auto"})
    for (const double sequence : {300.0, 3000.0, 4096.0, 1e5})
      for (const bool backward : {false, true})
        EXPECT_DOUBLE_EQ(b.sustained_attention_flops(backend, 128, sequence, backward),
                         a.sustained_attention_flops(backend, 128, sequence, backward))
            << backend << " " << sequence;
}

// A measured kernel's rate: the nearest head dimension's row (by ratio), linear in log2 of the
// sequence length between measured lengths, the end's rate beyond them.
TEST(AttentionRates, InterpolateInLogSequenceAndTakeTheNearestHeadDimension) {
  const AttentionRateTable t{.kernel = "test",
                             .forward = {{.head_dim = 64, .points = {{1024, 100}, {4096, 300}}},
                                         {.head_dim = 128, .points = {{1024, 200}, {4096, 400}}}},
                             .backward = {{.head_dim = 128, .points = {{1024, 50}}}}};
  EXPECT_DOUBLE_EQ(t.rate(128, 1024, false), 200);
  EXPECT_DOUBLE_EQ(t.rate(128, 2048, false), 300);  // halfway in log2
  EXPECT_DOUBLE_EQ(t.rate(128, 4096, false), 400);
  EXPECT_DOUBLE_EQ(t.rate(128, 512, false), 200);    // below the measured lengths: the first
  EXPECT_DOUBLE_EQ(t.rate(128, 65536, false), 400);  // above: the last
  EXPECT_DOUBLE_EQ(t.rate(80, 2048, false), 200);    // 80 is nearer 64 than 128 by ratio
  EXPECT_DOUBLE_EQ(t.rate(100, 2048, false), 300);   // 100 nearer 128
  EXPECT_DOUBLE_EQ(t.rate(256, 4096, false), 400);
  EXPECT_DOUBLE_EQ(t.rate(64, 4096, true), 50);  // the backward's own rows
  EXPECT_DOUBLE_EQ(AttentionRateTable{}.rate(128, 4096, false), 0);
}

// The H100 preset prices each attention backend at its measured kernel (the FlashAttention-3
// paper's figures at head dimension 128, scaled to the power-limited clock), auto at the kernel
// Transformer Engine picks on Hopper (cuDNN's), and a backend without a measured kernel at the
// flat efficiencies.
TEST(AttentionRates, TheH100PresetPricesEachBackendAtItsKernel) {
  const Accelerator h100 = Accelerator::load("h100-sxm");
  const double clock = h100.power_limited_clock_share;
  EXPECT_GT(clock, 0.5);
  EXPECT_LT(clock, 1);
  EXPECT_DOUBLE_EQ(h100.sustained_attention_flops("fused", 128, 4096, false), 518e12 * clock);
  EXPECT_DOUBLE_EQ(h100.sustained_attention_flops("fused", 128, 4096, true), 499e12 * clock);
  EXPECT_DOUBLE_EQ(h100.sustained_attention_flops("flash", 128, 4096, false), 319e12 * clock);
  EXPECT_DOUBLE_EQ(h100.sustained_attention_flops("flash", 128, 4096, true), 310e12 * clock);
  EXPECT_DOUBLE_EQ(h100.sustained_attention_flops("auto", 128, 4096, false),
                   h100.sustained_attention_flops("fused", 128, 4096, false));
  EXPECT_DOUBLE_EQ(h100.sustained_attention_flops("unfused", 128, 4096, false),
                   h100.sustained_attention_flops());
  // Shorter sequences run slower on every kernel.
  for (const char* backend : {"flash", "fused"})
    EXPECT_LT(h100.sustained_attention_flops(backend, 128, 1024, false),
              h100.sustained_attention_flops(backend, 128, 8192, false))
        << backend;
  // The products' rate is the power-limited clock's share of the measured one.
  EXPECT_DOUBLE_EQ(h100.sustained_flops(), h100.peak_flops * h100.matmul_efficiency * clock);
  // A preset without tables (A100's) prices every backend at its efficiencies, at full clock.
  const Accelerator a100 = Accelerator::load("a100-80gb");
  EXPECT_DOUBLE_EQ(a100.power_limited_clock_share, 1);
  EXPECT_DOUBLE_EQ(a100.sustained_attention_flops("auto", 128, 4096, true),
                   a100.sustained_attention_backward_flops());
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
  // Without the kernel model's fields: attention as fast as products, no shape effect.
  EXPECT_DOUBLE_EQ(a.attention_efficiency, 0.5);
  EXPECT_DOUBLE_EQ(a.matmul_overhead_dimension, 0);
  EXPECT_DOUBLE_EQ(a.attention_backward_efficiency, 0.5);
  EXPECT_DOUBLE_EQ(a.kernel_launch_us, 0);        // absent: kernels cost only their work
  EXPECT_DOUBLE_EQ(a.network.bus_efficiency, 1);  // absent: the line rate
  const std::string rest = R"("memory_bytes": 1e11, "memory_bandwidth": 4e12,
    "memory_efficiency": 1, "devices_per_node": 4,
    "node_link": {"bytes_per_second": 1e11, "latency_us": 1},
    "network": {"bytes_per_second": 1e10, "latency_us": 4}})";
  auto refused = [&](const std::string& fields, const std::string& expected) {
    try {
      Accelerator::parse(R"({"peak_flops": 1e15, "matmul_efficiency": 0.5, )" + fields + rest,
                         "test");
      ADD_FAILURE() << fields;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  refused(R"("matmul_overhead_dimension": -3,)",
          "'matmul_overhead_dimension' must be a number of rows in [0, 10^6], got -3");
  refused(R"("matmul_overhead_dimension": "big",)", "got \"big\"");
  refused(R"("attention_efficiency": 2,)", "'attention_efficiency' is a share of the peak");
  refused(R"("attention_kernels": {"fused": {"forward": {"128": {"4096": -5}}}},)",
          "head dimension 128 at sequence 4096 must be TFLOP/s > 0, got -5");
  refused(R"("attention_kernels": {"fused": {"forward": {"wide": {"4096": 5}}}},)",
          "'wide' is not a head dimension");
  refused(R"("attention_auto": "fused",)",
          "'attention_auto' names 'fused', which 'attention_kernels' does not hold");
  refused(R"("power_limited_clock_share": 1.5,)", "'power_limited_clock_share' is a share");
  refused(R"("kernel_launch_us": -1,)",
          "'kernel_launch_us' must be microseconds in [0, 1000], got -1");
  // A full mesh is a node's links, a true or false.
  auto links_refused = [&](const std::string& node_link, const std::string& network,
                           const std::string& expected) {
    try {
      Accelerator::parse(R"({"peak_flops": 1e15, "matmul_efficiency": 0.5, "memory_bytes": 1e11,
        "memory_bandwidth": 4e12, "memory_efficiency": 1, "devices_per_node": 4, "node_link": )" +
                             node_link + R"(, "network": )" + network + "}",
                         "test");
      ADD_FAILURE() << node_link << " " << network;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  links_refused(R"({"bytes_per_second": 1e11, "latency_us": 1})",
                R"({"bytes_per_second": 1e10, "latency_us": 4, "full_mesh": true})",
                "'full_mesh' is true or false, and true only for the node_link");
  links_refused(R"({"bytes_per_second": 1e11, "latency_us": 1, "full_mesh": "yes"})",
                R"({"bytes_per_second": 1e10, "latency_us": 4})", "got \"yes\"");
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
