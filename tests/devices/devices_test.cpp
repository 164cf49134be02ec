// Topology, device layout, pinning, the tracked allocator, link presets and the machine model.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <hwloc.h>
#include <sched.h>
#include <tbb/global_control.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/process_group.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/graph.hpp"

namespace weave::devices {
namespace {

// Results of work enqueued straight into an arena: static atomics, set before any thread
// exists, so the hand-off needs nothing from TBB.
std::atomic<bool> g_done{false};
std::atomic<std::uint64_t> g_mask{0};

std::set<int> cpus_of_this_thread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  std::set<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.insert(c);
  }
  return cpus;
}

TEST(Topology, DetectedHostIsConsistent) {
  const Topology t = Topology::detect();
  EXPECT_GE(t.packages(), 1);
  EXPECT_GE(t.numa_nodes(), 1);
  EXPECT_GE(t.cores(), 1);
  EXPECT_GE(t.pus(), t.cores());
  EXPECT_EQ(static_cast<int>(t.core_list().size()), t.cores());
  EXPECT_FALSE(t.is_synthetic());
  int pus = 0;
  for (const CoreInfo& c : t.core_list()) {
    EXPECT_FALSE(c.pus.empty());
    EXPECT_LT(c.numa_node, t.numa_nodes());
    pus += static_cast<int>(c.pus.size());
  }
  EXPECT_EQ(pus, t.pus());
  EXPECT_NE(t.describe().find("NUMA node 0"), std::string::npos);
}

TEST(Topology, SyntheticHostHasTheRequestedShape) {
  const Topology t = Topology::synthetic(2, 2, 4, 2);
  EXPECT_TRUE(t.is_synthetic());
  EXPECT_EQ(t.packages(), 2);
  EXPECT_EQ(t.numa_nodes(), 4);
  EXPECT_EQ(t.cores(), 16);
  EXPECT_EQ(t.pus(), 32);
  for (const CoreInfo& c : t.core_list()) {
    EXPECT_EQ(c.numa_node, c.index / 4) << "core " << c.index;
    EXPECT_EQ(c.package, c.index / 8) << "core " << c.index;
    EXPECT_EQ(c.pus.size(), 2u);
  }
  EXPECT_THROW(Topology::synthetic(0, 1, 1), std::invalid_argument);
}

TEST(Layout, FewerDevicesThanCoresGetBlocks) {
  const Topology t = Topology::synthetic(1, 2, 4);  // 8 cores on 2 NUMA nodes
  const auto four = layout_devices(t, 4);
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(four[d].cores, (std::vector<int>{2 * d, 2 * d + 1}));
    EXPECT_EQ(four[d].numa_node, d / 2);  // whole blocks stay inside a NUMA node
    EXPECT_EQ(four[d].sharing, 1);
  }
  const auto three = layout_devices(t, 3);  // 3, 3, 2
  EXPECT_EQ(three[0].cores.size(), 3u);
  EXPECT_EQ(three[1].cores.size(), 3u);
  EXPECT_EQ(three[2].cores.size(), 2u);
  const auto eight = layout_devices(t, 8);
  for (int d = 0; d < 8; ++d)
    EXPECT_EQ(eight[d].cores, std::vector<int>{d});
}

TEST(Layout, MoreDevicesThanCoresShare) {
  const Topology t = Topology::synthetic(1, 1, 2);  // this CI host's shape: 2 cores
  const auto layout = layout_devices(t, 8);
  ASSERT_EQ(layout.size(), 8u);
  for (int d = 0; d < 8; ++d) {
    EXPECT_EQ(layout[d].cores, std::vector<int>{d / 4});
    EXPECT_EQ(layout[d].sharing, 4);
  }
  const auto uneven = layout_devices(t, 3);  // cores 0, 0, 1
  EXPECT_EQ(uneven[0].sharing, 2);
  EXPECT_EQ(uneven[2].sharing, 1);
}

TEST(Layout, InvalidCountIsRefused) {
  const Topology t = Topology::synthetic(1, 1, 2);
  try {
    layout_devices(t, 0);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("at least 1 (got 0)"), std::string::npos);
  }
}

TEST(Device, WorkersArePinnedAndTheCallerIsNot) {
  const auto before = cpus_of_this_thread();
  DeviceSet set(2);
  for (rt::DeviceId d = 0; d < set.size(); ++d) {
    std::set<int> expected;
    for (int c : set.layout()[d].cores) {
      for (int pu : set.topology().core_list()[c].pus)
        expected.insert(pu);
    }
    // Enqueued work is run by a worker thread, which the observer pins on entry. The result
    // comes back through atomics only.
    g_done = false;
    set[d].arena().enqueue([] {
      std::uint64_t m = 0;
      for (int c : cpus_of_this_thread()) {
        if (c < 64) m |= std::uint64_t{1} << c;
      }
      g_mask = m;
      g_done = true;
    });
    for (int i = 0; i < 5000 && !g_done; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(g_done) << "no worker thread ran the device's work";
    std::set<int> seen;
    for (int c = 0; c < 64; ++c) {
      if (g_mask.load() >> c & 1) seen.insert(c);
    }
    EXPECT_EQ(seen, expected) << "device " << d;
  }
  // The calling thread helps run graphs and has its own affinity after the run.
  rt::GraphBuilder b;
  for (rt::DeviceId d = 0; d < set.size(); ++d)
    b.add({.device = d, .name = "t"});
  set.executor().run(b.build());
  EXPECT_EQ(cpus_of_this_thread(), before);
}

// The thread that calls run() takes a device's free arena slot to help and runs that device's
// tasks: while it does, it is bound to the device's cores like the device's own worker, so no
// device's work runs on another device's cores; after the run it has its own affinity back.
TEST(Device, EveryTaskRunsOnItsDevicesCoresWhicheverThreadRunsIt) {
  const auto before = cpus_of_this_thread();
  DeviceSet set(2);
  std::vector<std::set<int>> expected(set.size());
  for (rt::DeviceId d = 0; d < set.size(); ++d)
    for (int c : set.layout()[d].cores)
      for (int pu : set.topology().core_list()[c].pus)
        expected[d].insert(pu);
  constexpr int kTasks = 200;
  // Each task writes its own slot: where it ran and whether the calling thread ran it.
  std::vector<std::set<int>> ran_on(set.size() * kTasks);
  std::vector<char> by_caller(ran_on.size(), 0);
  const std::thread::id caller = std::this_thread::get_id();
  rt::GraphBuilder b;
  for (rt::DeviceId d = 0; d < set.size(); ++d)
    for (int i = 0; i < kTasks; ++i) {
      const std::size_t slot = d * kTasks + static_cast<std::size_t>(i);
      b.add({.device = d, .name = "t"}, [&, slot](rt::TaskContext&) {
        // A little work, so that the run lasts long enough for the caller to help.
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
        while (std::chrono::steady_clock::now() < until) {
        }
        ran_on[slot] = cpus_of_this_thread();
        by_caller[slot] = std::this_thread::get_id() == caller;
      });
    }
  set.executor().run(b.build());
  int helped = 0;
  for (rt::DeviceId d = 0; d < set.size(); ++d)
    for (int i = 0; i < kTasks; ++i) {
      const std::size_t slot = d * kTasks + static_cast<std::size_t>(i);
      EXPECT_EQ(ran_on[slot], expected[d])
          << "device " << d << ", task " << i << (by_caller[slot] ? ", run by the caller" : "");
      helped += by_caller[slot];
    }
  EXPECT_EQ(cpus_of_this_thread(), before);
  RecordProperty("tasks_run_by_the_caller", helped);
}

TEST(Device, AllocationsAreAlignedAndTracked) {
  DeviceSet set(2);
  auto& memory = set.memory();
  void* a = set[1].allocate(1000, rt::MemoryCategory::activations);
  void* b = set[1].allocate(24, rt::MemoryCategory::parameters);
  void* z = set[0].allocate(0, rt::MemoryCategory::workspace);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % 64, 0u);
  EXPECT_NE(z, nullptr);
  std::memset(a, 1, 1000);
  EXPECT_EQ(memory.current(1, rt::MemoryCategory::activations), 1000);
  EXPECT_EQ(memory.current(1, rt::MemoryCategory::parameters), 24);
  EXPECT_EQ(memory.current_total(1), 1024);
  EXPECT_EQ(memory.current_total(0), 0);
  set[1].deallocate(a, 1000, rt::MemoryCategory::activations);
  set[1].deallocate(b, 24, rt::MemoryCategory::parameters);
  set[0].deallocate(z, 0, rt::MemoryCategory::workspace);
  EXPECT_EQ(memory.current_total(1), 0);
  EXPECT_EQ(memory.peak_total(1), 1024);
}

TEST(DeviceSet, EightDevicesRunAGraphOnThisHost) {
  DeviceSet set(8);
  ASSERT_EQ(set.size(), 8u);
  rt::GraphBuilder b;
  std::vector<std::atomic<int>> runs(8 * 16);
  for (rt::DeviceId d = 0; d < 8; ++d) {
    for (int i = 0; i < 16; ++i) {
      b.add({.device = d, .name = fmt::format("d{}.{}", d, i)},
            [&runs, k = d * 16 + i](rt::TaskContext&) { runs[k]++; });
    }
  }
  const rt::Graph g = b.build();
  set.executor().run(g);
  set.executor().run(g);
  for (auto& r : runs)
    EXPECT_EQ(r.load(), 2);
}

TEST(LinkModel, PresetsHaveExactDurations) {
  const LinkModel none;
  EXPECT_FALSE(none.enabled());
  EXPECT_EQ(none.name(), "none");
  const LinkModel ampipe = LinkModel::preset("ampipe-20gbps");
  EXPECT_TRUE(ampipe.enabled());
  EXPECT_EQ(ampipe.link_between(0, 1), LinkClass::accelerator);
  // 1 MB at 20 GB/s = 50 us, plus one 10 us latency.
  EXPECT_EQ(ampipe.duration(1e6, 1, LinkClass::accelerator), 60'000);
  EXPECT_EQ(ampipe.duration(1e6, 0, LinkClass::accelerator), 60'000);  // at least one message
  EXPECT_EQ(ampipe.duration(0, 0, LinkClass::accelerator), 0);
  EXPECT_EQ(ampipe.duration(0, 3, LinkClass::accelerator), 30'000);
  const LinkModel host = LinkModel::preset("host");
  EXPECT_TRUE(host.enabled());
  EXPECT_EQ(host.link_between(0, 0), LinkClass::same_numa);
  EXPECT_EQ(host.link_between(0, 1), LinkClass::cross_numa);
  EXPECT_GT(host.duration(1e6, 1, LinkClass::cross_numa),
            host.duration(1e6, 1, LinkClass::same_numa));
  for (const auto& p : LinkModel::presets())
    EXPECT_NO_THROW(LinkModel::preset(p.name)) << p.name;
  EXPECT_EQ(LinkModel::presets().size(), 7u);
  // A custom accelerator link, GB/s:us.
  const LinkModel slow = LinkModel::preset("0.5:200");
  EXPECT_TRUE(slow.enabled());
  EXPECT_EQ(slow.link_between(0, 1), LinkClass::accelerator);
  EXPECT_EQ(slow.duration(1e6, 2, LinkClass::accelerator), 400'000 + 2'000'000);
  for (const char* bad : {"0:10", "-1:10", "fast:10", "20:", "20:-3", ":5"}) {
    try {
      LinkModel::preset(bad);
      ADD_FAILURE() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("GBPS:MICROSECONDS"), std::string::npos) << e.what();
    }
  }
}

TEST(LinkModel, UnknownPresetNamesTheValidOnes) {
  try {
    LinkModel::preset("nvlink5");
    FAIL();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("did you mean 'nvlink"), std::string::npos) << msg;
    EXPECT_NE(msg.find("ampipe-20gbps"), std::string::npos) << msg;
  }
  EXPECT_THROW(LinkModel::accelerator({.latency = 0, .bytes_per_second = 0}),
               std::invalid_argument);
  EXPECT_THROW(LinkModel::host({-1, 1e9}, {0, 1e9}), std::invalid_argument);
}

// A group's stride tells a cost model where every member sits from its first device alone.
TEST(ProcessGroup, DeviceStrideOfEvenlySpacedGroupsOnly) {
  EXPECT_EQ(ProcessGroup("tp", {4, 5, 6, 7}).device_stride(), 1u);
  EXPECT_EQ(ProcessGroup("dp", {1, 9, 17}).device_stride(), 8u);
  EXPECT_EQ(ProcessGroup("uneven", {0, 1, 3}).device_stride(), 0u);
  EXPECT_EQ(ProcessGroup("descending", {3, 2, 1}).device_stride(), 0u);
  EXPECT_EQ(ProcessGroup("one", {5}).device_stride(), 0u);
}

TEST(MachineModel, CostsComputeAndTransfersByLinkClass) {
  const LinkModel links = LinkModel::host({1'000, 10e9}, {2'000, 5e9});
  // Devices 0, 1 on NUMA node 0; device 2 on node 1.
  const MachineModel model({0, 0, 1}, 1e9, links);
  rt::GraphBuilder b;
  const rt::TaskId c = b.add({.device = 0, .name = "gemm", .cost = {.flops = 5e6}});
  auto comm = [&](rt::DeviceId d) {
    return b.add({.device = d,
                  .stream = rt::kCommStream,
                  .kind = rt::TaskKind::comm,
                  .name = "x",
                  .cost = {.bytes = 1e6, .messages = 2}});
  };
  const rt::TaskId near[] = {comm(0), comm(1)};
  const rt::TaskId far[] = {comm(0), comm(2)};
  b.rendezvous("near", near);
  b.rendezvous("far", far);
  const rt::TaskId h = b.add({.device = 1, .kind = rt::TaskKind::host, .name = "h"});
  const rt::Graph g = b.build();
  EXPECT_EQ(model.duration(g.tasks(), c), 5'000'000);
  EXPECT_EQ(model.duration(g.tasks(), near[0]), 2 * 1'000 + 100'000);
  EXPECT_EQ(model.duration(g.tasks(), far[0]), 2 * 2'000 + 200'000);  // the slow link sets it
  EXPECT_EQ(model.duration(g.tasks(), far[1]), 2 * 2'000 + 200'000);
  EXPECT_EQ(model.duration(g.tasks(), h), 0);
  const MachineModel small({0}, 1e9, links);
  EXPECT_THROW(small.duration(g.tasks(), near[1]), std::out_of_range);
  EXPECT_THROW(MachineModel({0}, 0, links), std::invalid_argument);
}

TEST(MachineModel, ComputeIsBoundByArithmeticOrByMemoryWhicheverIsLonger) {
  const LinkModel links = LinkModel::host({1'000, 10e9}, {2'000, 5e9});
  const MachineModel model({0}, 1e9, links, 1e10);  // 1 GFLOP/s, 10 GB/s
  rt::GraphBuilder b;
  const rt::TaskId norm =
      b.add({.device = 0, .name = "norm", .cost = {.flops = 1e3, .bytes = 4e6}});
  const rt::TaskId gemm =
      b.add({.device = 0, .name = "gemm", .cost = {.flops = 5e6, .bytes = 4e6}});
  const rt::Graph g = b.build();
  EXPECT_EQ(model.duration(g.tasks(), norm), 400'000);    // 4 MB at 10 GB/s
  EXPECT_EQ(model.duration(g.tasks(), gemm), 5'000'000);  // 5 MFLOP at 1 GFLOP/s
  // Without a bandwidth memory traffic is free, as before.
  EXPECT_EQ(MachineModel({0}, 1e9, links).duration(g.tasks(), norm), 1'000);
  EXPECT_THROW(MachineModel({0}, 1e9, links, -1), std::invalid_argument);
}

TEST(MachineModel, KernelRatesSumProductsAttentionAndStreaming) {
  const LinkModel links = LinkModel::host({1'000, 10e9}, {2'000, 5e9});
  const KernelRates rates{.matmul_flops_per_second = 1e9,
                          .matmul_overhead_dimension = 10,
                          .attention_flops_per_second = 5e8,
                          .memory_bytes_per_second = 1e10};
  const MachineModel model({0}, rates, links);
  rt::GraphBuilder b;
  // One [100, 200] x [200, 50] product: 2 mnk (1 + d0/m + d0/k + d0/n) at 1 GFLOP/s.
  const double m = 100, k = 200, n = 50;
  const rt::TaskId product =
      b.add({.device = 0,
             .name = "product",
             .cost = {.flops = 2 * m * k * n,
                      .matmul_edges = static_cast<float>(2 * (m * k + k * n + m * n))}});
  // 1 MFLOP of attention beside the product, and 4 MB streamed: each at its own rate, summed.
  const rt::TaskId mixed =
      b.add({.device = 0,
             .name = "mixed",
             .cost = {.flops = 2 * m * k * n + 1e6,
                      .bytes = 4e6,
                      .attention_flops = 1e6,
                      .matmul_edges = static_cast<float>(2 * (m * k + k * n + m * n))}});
  const rt::Graph g = b.build();
  const double product_ns = 2 * m * k * n * (1 + 10 / m + 10 / k + 10 / n);  // at 1 GFLOP/s
  EXPECT_EQ(model.duration(g.tasks(), product), std::llround(product_ns));
  EXPECT_EQ(model.duration(g.tasks(), mixed), std::llround(product_ns + 2e6 + 4e5));
  // Without the overhead dimension the product runs at the full rate.
  const MachineModel square(
      {0}, KernelRates{.matmul_flops_per_second = 1e9, .attention_flops_per_second = 5e8}, links);
  EXPECT_EQ(square.duration(g.tasks(), product), std::llround(2 * m * k * n));
  // A backward task's attention runs at the backward's rate when one is given.
  const MachineModel split({0},
                           KernelRates{.matmul_flops_per_second = 1e9,
                                       .attention_flops_per_second = 5e8,
                                       .attention_backward_flops_per_second = 2.5e8},
                           links);
  rt::GraphBuilder bb;
  const rt::TaskTags backward{.phase = rt::Phase::backward};
  const rt::TaskId fwd =
      bb.add({.device = 0, .name = "f", .cost = {.flops = 1e6, .attention_flops = 1e6}});
  const rt::TaskId bwd = bb.add(
      {.device = 0, .name = "b", .tags = backward, .cost = {.flops = 1e6, .attention_flops = 1e6}});
  const rt::Graph gb = bb.build();
  EXPECT_EQ(split.duration(gb.tasks(), fwd), 2'000'000);
  EXPECT_EQ(split.duration(gb.tasks(), bwd), 4'000'000);
  auto refused = [&](KernelRates r, const std::string& expected) {
    try {
      MachineModel({0}, r, links);
      ADD_FAILURE() << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  // Each kernel a task stands for (its hint's messages) costs the launch figure on top.
  const MachineModel launched({0},
                              KernelRates{.matmul_flops_per_second = 1e9,
                                          .attention_flops_per_second = 5e8,
                                          .memory_bytes_per_second = 1e10,
                                          .kernel_launch_seconds = 2e-6},
                              links);
  rt::GraphBuilder bl;
  const rt::TaskId three =
      bl.add({.device = 0, .name = "three", .cost = {.flops = 1e6, .bytes = 1e6, .messages = 3}});
  const rt::Graph gl = bl.build();
  EXPECT_EQ(launched.duration(gl.tasks(), three), 1'000'000 + 100'000 + 3 * 2'000);
  refused({.matmul_flops_per_second = 1e9}, "attention rate (FLOP/s) must be a finite figure > 0");
  refused({.matmul_flops_per_second = 1e9,
           .attention_flops_per_second = 1e9,
           .kernel_launch_seconds = -1},
          "per-kernel launch cost (s) must be a finite figure >= 0 (got -1)");
  refused({.matmul_flops_per_second = 1e9,
           .matmul_overhead_dimension = -1,
           .attention_flops_per_second = 1e9},
          "overhead dimension (rows) must be a finite figure >= 0 (got -1)");
}

}  // namespace
}  // namespace weave::devices
