// The cluster model: devices on nodes by global rank, and each collective costed on the virtual
// clock by the algorithm its group would use there, against the algorithm's closed form.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "weave/devices/cluster.hpp"
#include "weave/devices/folded_communicator.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::devices {
namespace {

// 8 devices a node; a node link of 100 GB/s and 2 us per device, a NIC of 25 GB/s and 5 us.
constexpr double kNodeBandwidth = 100e9, kNodeLatency = 2e-6;
constexpr double kNetworkBandwidth = 25e9, kNetworkLatency = 5e-6;
constexpr int kDevicesPerNode = 8;
constexpr int kDevices = 32;  // four nodes

Cluster test_cluster(bool full_mesh = false) {
  return Cluster(kDevicesPerNode,
                 {.name = "node link", .params = {2'000, kNodeBandwidth}, .full_mesh = full_mesh},
                 {.name = "network", .params = {5'000, kNetworkBandwidth}});
}

// The closed forms, in seconds (alpha-beta model).
double node(double messages, double bytes) {
  return messages * kNodeLatency + bytes / kNodeBandwidth;
}
double net(double messages, double bytes) {
  return messages * kNetworkLatency + bytes / kNetworkBandwidth;
}
double ceil_log2(int n) {
  return std::bit_width(static_cast<unsigned>(n - 1));
}

// One collective over `ranks` (only the `held` ones built, as a folded step builds them),
// replayed on the virtual clock with or without the cluster: its makespan in seconds.
enum class Op { all_reduce, all_gather, reduce_scatter, all_to_all, send_recv, broadcast, barrier };

double replay(Op op, const std::vector<rt::DeviceId>& ranks, std::size_t floats, bool with_cluster,
              std::vector<bool> held = {}, bool full_mesh = false) {
  if (held.empty()) held.assign(kDevices, true);
  FoldedCommunicator comm(held);
  rt::GraphBuilder b;
  const ProcessGroup group("g", ranks);
  const std::size_t n = ranks.size();
  // Real buffers of the sizes the op checks; a folded replay neither reads nor writes them.
  const std::size_t in_floats = op == Op::all_reduce || op == Op::broadcast ? 0
                                : op == Op::reduce_scatter                  ? floats * n
                                                                            : floats;
  std::vector<std::vector<float>> in(n, std::vector<float>(in_floats)),
      out(n, std::vector<float>(op == Op::all_gather ? floats * n : floats));
  std::vector<std::span<const float>> inputs;
  std::vector<std::span<float>> outputs;
  for (std::size_t r = 0; r < n; ++r) {
    inputs.emplace_back(in[r]);
    outputs.emplace_back(out[r]);
  }
  switch (op) {
    case Op::all_reduce:
      comm.all_reduce(b, group, outputs, ReduceOp::sum);
      break;
    case Op::all_gather:
      comm.all_gather(b, group, inputs, outputs);
      break;
    case Op::reduce_scatter:
      comm.reduce_scatter(b, group, inputs, outputs, ReduceOp::sum);
      break;
    case Op::all_to_all:
      comm.all_to_all(b, group, inputs, outputs);
      break;
    case Op::send_recv:
      comm.send_recv(b, ranks[0], inputs[0], ranks[1], outputs[1]);
      break;
    case Op::broadcast:
      comm.broadcast(b, group, outputs, 0);
      break;
    case Op::barrier:
      comm.barrier(b, group);
      break;
  }
  const rt::Graph g = b.build();
  const LinkModel one_link = LinkModel::accelerator({2'000, kNodeBandwidth});
  const MachineModel machine(
      std::vector<int>(kDevices, 0), 1e12, one_link, 0,
      with_cluster ? std::optional<Cluster>(test_cluster(full_mesh)) : std::nullopt);
  rt::VirtualClock clock(machine, {.execute = false, .record_trace = false});
  return static_cast<double>(clock.run(g).makespan) * 1e-9;
}

std::vector<rt::DeviceId> ranks(rt::DeviceId first, rt::DeviceId stride, int size) {
  std::vector<rt::DeviceId> out;
  for (int i = 0; i < size; ++i)
    out.push_back(first + static_cast<rt::DeviceId>(i) * stride);
  return out;
}

constexpr double kNs = 1.5e-9;  // each term rounds to whole ns

TEST(Cluster, DevicesMapToNodesByGlobalRank) {
  const Cluster c = test_cluster();
  EXPECT_EQ(c.node_of(0), 0);
  EXPECT_EQ(c.node_of(7), 0);
  EXPECT_EQ(c.node_of(8), 1);
  EXPECT_EQ(c.node_of(31), 3);
  EXPECT_EQ(c.nodes_for(32), 4);
  EXPECT_EQ(c.nodes_for(33), 5);
  // A tensor-parallel group (stride 1), a data-parallel one across nodes (stride 8), and a group
  // of 16 straddling two nodes from rank 4 (4, 8 and 4 members on nodes 0, 1, 2).
  const GroupPlacement tp = c.place(8, 1, 8), dp = c.place(3, 8, 4), odd = c.place(4, 1, 16);
  EXPECT_EQ(tp.nodes, 1);
  EXPECT_EQ(tp.per_node, 8);
  EXPECT_EQ(dp.nodes, 4);
  EXPECT_EQ(dp.per_node, 1);
  EXPECT_EQ(odd.nodes, 3);
  EXPECT_EQ(odd.per_node, 8);
  const GroupPlacement listed = c.place(std::vector<std::uint32_t>{17, 1, 9, 2});
  EXPECT_EQ(listed.nodes, 3);
  EXPECT_EQ(listed.per_node, 2);
}

TEST(Cluster, AllReduceInANodeIsTheFasterOfRingAndTree) {
  const double big = 8.0 * 1024 * 1024, small = 4096;  // bytes
  const double ring_big = node(2 * 7, 2 * 7.0 / 8 * big), tree_big = node(2 * 3, 2 * big);
  const double ring_small = node(2 * 7, 2 * 7.0 / 8 * small), tree_small = node(2 * 3, 2 * small);
  ASSERT_LT(ring_big, tree_big);      // bandwidth-bound: the ring
  ASSERT_LT(tree_small, ring_small);  // latency-bound: the tree
  EXPECT_NEAR(replay(Op::all_reduce, ranks(8, 1, 8), big / 4, true), ring_big, kNs);
  EXPECT_NEAR(replay(Op::all_reduce, ranks(8, 1, 8), small / 4, true), tree_small, kNs);
}

TEST(Cluster, AllReduceAcrossNodesIsHierarchical) {
  const double s = 1024.0 * 1024;
  // Two nodes of 8: reduce-scatter and all-gather in the node, an all-reduce of s / 8 between
  // the 2 nodes' same local ranks (at 2 members the ring moves half what the tree does).
  const double two = 2 * node(7, 7.0 / 8 * s) + net(2, 2 * 0.5 * s / 8);
  ASSERT_LT(net(2, 2 * 0.5 * s / 8), net(2, 2 * s / 8));
  EXPECT_NEAR(replay(Op::all_reduce, ranks(0, 1, 16), s / 4, true), two, kNs);
  // Four nodes of 8: the inter-node step among 4 peers on s / 8, ring or tree.
  const double four = 2 * node(7, 7.0 / 8 * s) +
                      std::min(net(2 * 3, 2 * 3.0 / 4 * s / 8), net(2 * ceil_log2(4), 2 * s / 8));
  EXPECT_NEAR(replay(Op::all_reduce, ranks(0, 1, 32), s / 4, true), four, kNs);
  // One member on each of 4 nodes (a data-parallel group): no intra-node step; small buffers
  // take the tree over the network.
  const double tiny = 4096;
  const double tree = net(2 * ceil_log2(4), 2 * tiny);
  ASSERT_LT(tree, net(2 * 3, 2 * 3.0 / 4 * tiny));
  EXPECT_NEAR(replay(Op::all_reduce, ranks(1, 8, 4), tiny / 4, true), tree, kNs);
  // Faster than one flat ring of 32 through the network, which the hierarchy exists to avoid.
  EXPECT_LT(four, net(2 * 31, 2 * 31.0 / 32 * s));
}

TEST(Cluster, AllGatherAndReduceScatterAcrossNodesTakeTwoLevels) {
  const double shard = 16.0 * 1024;  // floats a member contributes (all-gather) or keeps
  const double s = shard * 4 * 16;   // bytes of the whole buffer over 16 members
  EXPECT_NEAR(replay(Op::all_gather, ranks(0, 1, 8), shard, true),
              node(7, 7.0 / 8 * (shard * 4 * 8)), kNs);
  const double two_levels = node(7, 7.0 / 8 * s) + net(1, 0.5 * s / 8);
  EXPECT_NEAR(replay(Op::all_gather, ranks(0, 1, 16), shard, true), two_levels, kNs);
  EXPECT_NEAR(replay(Op::reduce_scatter, ranks(0, 1, 16), shard, true), two_levels, kNs);
  EXPECT_LT(two_levels, net(15, 15.0 / 16 * s));  // than a flat ring through the network
}

TEST(Cluster, AllToAllMessagesAreInFlightTogether) {
  const double floats = 256.0 * 1024, s = floats * 4;  // each member's send buffer
  // In one node: one latency and 7 / 8 of the buffer through the node link, where the serial
  // cost (without a cluster) pays 7 latencies one after another.
  const double overlapped = node(1, 7.0 / 8 * s), serial = node(7, 7.0 / 8 * s);
  EXPECT_NEAR(replay(Op::all_to_all, ranks(0, 1, 8), floats, true), overlapped, kNs);
  EXPECT_NEAR(replay(Op::all_to_all, ranks(0, 1, 8), floats, false), serial, kNs);
  // Across 2 nodes of 8: 7 / 16 over the node link, 8 / 16 over the NIC; the NIC is busier.
  const double across = std::max(node(1, 7.0 / 16 * s), net(1, 8.0 / 16 * s));
  EXPECT_NEAR(replay(Op::all_to_all, ranks(0, 1, 16), floats, true), across, kNs);
  // Across 4 nodes, one member each: every message over the network.
  EXPECT_NEAR(replay(Op::all_to_all, ranks(2, 8, 4), floats, true), net(1, 3.0 / 4 * s), kNs);
}

// A node whose devices each have a link of their own to every other (HCCS on an Atlas 800T A2),
// the node link's figures one link's: a collective among k devices of a node exchanges over its
// k - 1 links at once (HCCL's Mesh algorithm), the ring's formula at k - 1 times the bandwidth;
// one pair uses one link.
TEST(Cluster, AFullMeshNodeExchangesOverEveryLinkAtOnce) {
  const double floats = 256.0 * 1024, s = floats * 4;
  auto mesh = [](int links, double messages, double bytes) {
    return messages * kNodeLatency + bytes / (links * kNodeBandwidth);
  };
  const std::vector<bool> all(kDevices, true);
  EXPECT_NEAR(replay(Op::all_gather, ranks(0, 1, 8), floats, true, all, true),
              mesh(7, 7, 7.0 / 8 * s * 8), kNs);
  EXPECT_NEAR(replay(Op::reduce_scatter, ranks(0, 1, 4), floats, true, all, true),
              mesh(3, 3, 3.0 / 4 * s * 4), kNs);
  const double big = 64 * floats;  // bandwidth-bound: the ring's two passes, over 7 links
  ASSERT_LT(mesh(7, 2 * 7, 2 * 7.0 / 8 * big * 4), mesh(7, 2 * 3, 2 * big * 4));
  EXPECT_NEAR(replay(Op::all_reduce, ranks(0, 1, 8), big, true, all, true),
              mesh(7, 2 * 7, 2 * 7.0 / 8 * big * 4), kNs);
  EXPECT_NEAR(replay(Op::all_to_all, ranks(0, 1, 8), floats, true, all, true),
              mesh(7, 1, 7.0 / 8 * s), kNs);
  // Across two nodes the mesh carries the node's level, the network the rest.
  EXPECT_NEAR(replay(Op::all_gather, ranks(0, 1, 16), floats, true, all, true),
              mesh(7, 7, 7.0 / 8 * s * 16) + net(1, 0.5 * s * 16 / 8), kNs);
  EXPECT_NEAR(replay(Op::send_recv, {6, 7}, floats, true, all, true), node(1, s), kNs);
  EXPECT_NEAR(replay(Op::broadcast, ranks(0, 1, 8), floats, true, all, true), node(7, s), kNs);
  // On a switched node link of that bandwidth a device, the same latencies and 7 times the
  // time moving the bytes.
  const double switched = replay(Op::all_gather, ranks(0, 1, 8), floats, true);
  const double meshed = replay(Op::all_gather, ranks(0, 1, 8), floats, true, all, true);
  EXPECT_NEAR(switched - 7 * kNodeLatency, 7 * (meshed - 7 * kNodeLatency), 8 * kNs);
}

TEST(Cluster, SendRecvBetweenNodesPaysTheNetwork) {
  const double floats = 1e6, s = floats * 4;
  EXPECT_NEAR(replay(Op::send_recv, {6, 7}, floats, true), node(1, s), kNs);
  EXPECT_NEAR(replay(Op::send_recv, {7, 8}, floats, true), net(1, s), kNs);
}

TEST(Cluster, BroadcastAndBarrierCrossTheNetworkWhenTheGroupSpansNodes) {
  const double floats = 1e5, s = floats * 4;
  // A pipelined chain: n - nodes hops in a node, nodes - 1 across, at the slower link's pace.
  EXPECT_NEAR(replay(Op::broadcast, ranks(0, 1, 8), floats, true), node(7, s), kNs);
  EXPECT_NEAR(replay(Op::broadcast, ranks(4, 1, 8), floats, true), node(6, 0) + net(1, s), kNs);
  // Dissemination: ceil(log2 n) rounds of latency.
  EXPECT_NEAR(replay(Op::barrier, ranks(0, 1, 8), 0, true), node(3, 0), kNs);
  EXPECT_NEAR(replay(Op::barrier, ranks(0, 1, 32), 0, true), net(5, 0), kNs);
}

TEST(Cluster, AllGatherAcrossFourNodes) {
  const double shard = 16.0 * 1024, s = shard * 4 * 32;
  EXPECT_NEAR(replay(Op::all_gather, ranks(0, 1, 32), shard, true),
              node(7, 7.0 / 8 * s) + net(3, 3.0 / 4 * s / 8), kNs);
  // One member a node: the ring runs through the network alone.
  EXPECT_NEAR(replay(Op::reduce_scatter, ranks(5, 8, 4), shard, true),
              net(3, 3.0 / 4 * shard * 4 * 4), kNs);
}

// A variable all-to-all reports its real split when it runs (the ring's bytes, without a
// pattern): the cluster prices that volume with the hint's group.
TEST(Cluster, AReportedCostKeepsTheGroupsAlgorithm) {
  FoldedCommunicator comm(std::vector<bool>(kDevices, true));
  rt::GraphBuilder b;
  const ProcessGroup group("g", ranks(0, 1, 16));
  std::vector<std::vector<float>> in(16, std::vector<float>(16)), out = in;
  std::vector<std::span<const float>> inputs(in.begin(), in.end());
  std::vector<std::span<float>> outputs(out.begin(), out.end());
  const Communicator::MemberTasks tasks = comm.all_to_all(b, group, inputs, outputs);
  const rt::Graph g = b.build();
  const MachineModel machine(std::vector<int>(kDevices, 0), 1e12,
                             LinkModel::accelerator({2'000, kNodeBandwidth}), 0, test_cluster());
  const double sent = 15.0 / 16 * 4e6;  // what the member sent to the others
  const double seconds =
      static_cast<double>(machine.duration(g.tasks(), tasks[0], {.bytes = sent, .messages = 15})) *
      1e-9;
  EXPECT_NEAR(seconds, std::max(node(1, 7.0 / 16 * 4e6), net(1, 8.0 / 16 * 4e6)), kNs);
}

// Folding builds one member of a data-parallel group: the group's nodes come from its cost hint,
// not from the members in the graph, so it costs what the whole group does.
TEST(Cluster, AFoldedGroupIsPlacedByItsGlobalRanks) {
  std::vector<bool> first_only(kDevices, false);
  first_only[3] = true;
  for (const double floats : {1024.0, 256.0 * 1024}) {
    for (const Op op : {Op::all_reduce, Op::all_gather, Op::reduce_scatter, Op::all_to_all}) {
      const double every = replay(op, ranks(3, 8, 4), static_cast<std::size_t>(floats), true);
      EXPECT_EQ(replay(op, ranks(3, 8, 4), static_cast<std::size_t>(floats), true, first_only),
                every);
      EXPECT_GT(every, 0);
    }
  }
}

TEST(Cluster, FlagsAreCheckedWithTheRuleAndTheFix) {
  const auto message = [](auto build) {
    try {
      build();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] {
              Cluster::parse_link("50", "--network");
            }).find("--network '50': a link is GBPS:MICROSECONDS"),
            std::string::npos);
  EXPECT_NE(message([] { Cluster::parse_link("0:5", "--network"); }).find("say 50:5"),
            std::string::npos);
  EXPECT_NE(message([] { Cluster::parse_link("450:-1", "--node-link"); }).find("--node-link"),
            std::string::npos);
  EXPECT_NE(message([] { Cluster::parse_link("x:1", "--node-link"); }).find("greater than 0"),
            std::string::npos);
  EXPECT_NE(message([] {
              Cluster::from_overrides({.devices_per_node = 8, .node_link = "450:3"});
            }).find("(missing --network)"),
            std::string::npos);
  EXPECT_NE(message([] {
              Cluster(0, {.name = "a", .params = {1, 1e9}}, {.name = "b", .params = {1, 1e9}});
            }).find("--devices-per-node must be a whole number from 1 to 1000000 (got 0)"),
            std::string::npos);
  const LinkParams p = Cluster::parse_link("50:5", "--network");
  EXPECT_EQ(p.latency, 5'000);
  EXPECT_EQ(p.bytes_per_second, 50e9);
  // An accelerator's node, its figures overridden by the flags given.
  const Accelerator h100 = Accelerator::load("h100-sxm");
  const Cluster preset = Cluster::from_accelerator(h100);
  EXPECT_EQ(preset.devices_per_node(), 8);
  // At the bus bandwidth collectives reach: the line rate times the preset's bus efficiency.
  EXPECT_DOUBLE_EQ(preset.network().params.bytes_per_second,
                   h100.network.bytes_per_second * h100.network.bus_efficiency);
  EXPECT_LT(h100.network.bus_efficiency, 1);
  EXPECT_DOUBLE_EQ(preset.node_link().params.bytes_per_second,
                   h100.node_link.bytes_per_second * h100.node_link.bus_efficiency);
  const Cluster custom =
      Cluster::from_accelerator(h100, {.devices_per_node = 4, .network = "25:10"});
  EXPECT_EQ(custom.devices_per_node(), 4);
  EXPECT_DOUBLE_EQ(custom.node_link().params.bytes_per_second, 450e9 * 0.8);
  EXPECT_EQ(custom.network().params.bytes_per_second, 25e9);  // a flag's figure is the bus's
  EXPECT_EQ(custom.network().params.latency, 10'000);
  EXPECT_NE(custom.describe(16).find("4 nodes x 4 devices (16 used)"), std::string::npos)
      << custom.describe(16);
}

}  // namespace
}  // namespace weave::devices
