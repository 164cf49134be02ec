#include "weave/devices/cluster.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

namespace weave::devices {

namespace {

constexpr int kMaxDevicesPerNode = 1'000'000;

void check_link(const ClusterLink& link, std::string_view which) {
  const LinkParams& p = link.params;
  if (!(p.bytes_per_second > 0) || !std::isfinite(p.bytes_per_second) || p.latency < 0)
    throw std::invalid_argument(fmt::format(
        "the cluster's {} ('{}') needs a bandwidth > 0 bytes/s and a latency >= 0 (got {} B/s, "
        "{} ns): give GBPS:MICROSECONDS such as 50:5",
        which, link.name, p.bytes_per_second, p.latency));
}

ClusterLink from_network_link(const NetworkLink& link) {
  return {.name = link.name,
          .params = {.latency = static_cast<rt::Nanos>(std::llround(link.latency_us * 1e3)),
                     .bytes_per_second = link.bytes_per_second}};
}

// Seconds, per term of the alpha-beta model: `messages` latencies one after another and
// `bytes` through one link.
double alpha_beta(double messages, double bytes, const LinkParams& link) {
  return messages * static_cast<double>(link.latency) * 1e-9 + bytes / link.bytes_per_second;
}

// Ring all-gather or reduce-scatter of `bytes` (the whole gathered buffer) over n members: n - 1
// steps, each moving a 1/n share through every member's link (Patarasuk and Yuan 2009; NCCL's
// ring: busBw = algBw (n - 1) / n).
double ring_gather(int n, double bytes, const LinkParams& link) {
  if (n <= 1) return 0;
  return alpha_beta(n - 1, static_cast<double>(n - 1) / n * bytes, link);
}

// Ring all-reduce: a reduce-scatter then an all-gather, 2 (n - 1) steps of bytes / n.
double ring_all_reduce(int n, double bytes, const LinkParams& link) {
  return 2 * ring_gather(n, bytes, link);
}

// Double binary tree all-reduce (NCCL 2.4): a reduce up and a broadcast down, pipelined, each
// tree carrying half the buffer; every member sends and receives about the whole buffer per
// phase, and the depth is ceil(log2 n). Latency-bound sizes favour it, large ones the ring.
double tree_all_reduce(int n, double bytes, const LinkParams& link) {
  if (n <= 1) return 0;
  const int depth = std::bit_width(static_cast<unsigned>(n - 1));  // ceil(log2 n)
  return alpha_beta(2.0 * depth, 2 * bytes, link);
}

// The faster of ring and tree, as NCCL's tuner chooses between its algorithms' estimates.
double best_all_reduce(int n, double bytes, const LinkParams& link) {
  return std::min(ring_all_reduce(n, bytes, link), tree_all_reduce(n, bytes, link));
}

}  // namespace

Cluster::Cluster(int devices_per_node, ClusterLink node_link, ClusterLink network)
    : devices_per_node_(devices_per_node),
      node_link_(std::move(node_link)),
      network_(std::move(network)) {
  if (devices_per_node < 1 || devices_per_node > kMaxDevicesPerNode)
    throw std::invalid_argument(fmt::format(
        "--devices-per-node must be a whole number from 1 to {} (got {}): give how many devices "
        "one node holds, 8 for a DGX or an Atlas 800T",
        kMaxDevicesPerNode, devices_per_node));
  check_link(node_link_, "node link (--node-link)");
  check_link(network_, "network (--network)");
}

LinkParams Cluster::parse_link(std::string_view spec, std::string_view flag) {
  const std::size_t colon = spec.find(':');
  const std::string gbps(spec.substr(0, colon));
  const std::string micros(colon == std::string_view::npos ? "" : spec.substr(colon + 1));
  char* end = nullptr;
  const double bandwidth = std::strtod(gbps.c_str(), &end);
  const bool bandwidth_ok =
      !gbps.empty() && *end == '\0' && std::isfinite(bandwidth) && bandwidth > 0;
  const double latency = std::strtod(micros.c_str(), &end);
  const bool latency_ok = colon != std::string_view::npos && !micros.empty() && *end == '\0' &&
                          std::isfinite(latency) && latency >= 0 && latency <= 1e9;
  if (!bandwidth_ok || !latency_ok)
    throw std::invalid_argument(fmt::format(
        "{} '{}': a link is GBPS:MICROSECONDS, a bandwidth per device in GB/s greater than 0 and "
        "a per-message latency in microseconds from 0 to 10^9 (say {})",
        flag, spec, flag == "--network" ? "50:5" : "450:3"));
  return {.latency = static_cast<rt::Nanos>(std::llround(latency * 1e3)),
          .bytes_per_second = bandwidth * 1e9};
}

Cluster Cluster::from_accelerator(const Accelerator& a, const ClusterOverrides& o) {
  ClusterLink node = from_network_link(a.node_link);
  ClusterLink network = from_network_link(a.network);
  if (!o.node_link.empty())
    node = {.name = o.node_link, .params = parse_link(o.node_link, "--node-link")};
  if (!o.network.empty())
    network = {.name = o.network, .params = parse_link(o.network, "--network")};
  return Cluster(o.devices_per_node != 0 ? o.devices_per_node : a.devices_per_node, std::move(node),
                 std::move(network));
}

Cluster Cluster::from_overrides(const ClusterOverrides& o) {
  for (const auto& [given, flag] :
       {std::pair{o.devices_per_node != 0, "--devices-per-node"},
        std::pair{!o.node_link.empty(), "--node-link"}, std::pair{!o.network.empty(), "--network"}})
    if (!given)
      throw std::invalid_argument(fmt::format(
          "a cluster without --accelerator needs --devices-per-node, --node-link and --network "
          "(missing {}): give it, or --accelerator for a preset's node",
          flag));
  return Cluster(o.devices_per_node,
                 {.name = o.node_link, .params = parse_link(o.node_link, "--node-link")},
                 {.name = o.network, .params = parse_link(o.network, "--network")});
}

GroupPlacement Cluster::place(std::uint32_t first, std::uint32_t stride, int size) const {
  std::vector<std::uint32_t> ranks(static_cast<std::size_t>(std::max(size, 0)));
  for (int i = 0; i < size; ++i)
    ranks[static_cast<std::size_t>(i)] = first + static_cast<std::uint32_t>(i) * stride;
  return place(std::move(ranks));
}

GroupPlacement Cluster::place(std::vector<std::uint32_t> ranks) const {
  // In ascending order a node's members come one after another.
  std::sort(ranks.begin(), ranks.end());
  GroupPlacement g{.size = static_cast<int>(ranks.size()), .nodes = 0, .per_node = 0};
  int previous = -1, run = 0;
  for (const std::uint32_t rank : ranks) {
    const int node = node_of(rank);
    run = node == previous ? run + 1 : 1;
    g.nodes += node != previous;
    g.per_node = std::max(g.per_node, run);
    previous = node;
  }
  return g;
}

rt::Nanos Cluster::collective_duration(rt::TransferPattern pattern, double payload,
                                       const GroupPlacement& group) const {
  const int n = group.size, nodes = group.nodes, k = group.per_node;
  const LinkParams& intra = node_link_.params;
  const LinkParams& inter = network_.params;
  const bool spans = nodes > 1;
  double seconds = 0;
  switch (pattern) {
    case rt::TransferPattern::none:
      return 0;
    case rt::TransferPattern::all_reduce:
      if (n <= 1) return 0;
      // One node: the faster of ring and tree over the node link. Across nodes (hierarchical):
      // reduce-scatter inside the node, all-reduce of the node's 1/k share between the nodes'
      // same local ranks (each over its own NIC), all-gather inside the node.
      seconds =
          !spans ? best_all_reduce(n, payload, intra)
                 : ring_all_reduce(k, payload, intra) + best_all_reduce(nodes, payload / k, inter);
      break;
    case rt::TransferPattern::all_gather:
    case rt::TransferPattern::reduce_scatter:
      if (n <= 1) return 0;
      // Ring inside the node; across nodes a ring between the nodes over 1/k of the buffer (each
      // local rank's share) and a ring inside each node over the whole.
      seconds = !spans ? ring_gather(n, payload, intra)
                       : ring_gather(k, payload, intra) + ring_gather(nodes, payload / k, inter);
      break;
    case rt::TransferPattern::all_to_all: {
      if (n <= 1) return 0;
      // payload / n to each peer, every message in flight together: k - 1 peers over the node
      // link, n - k over the member's NIC; the busier link, plus one latency, sets the time.
      const double share = payload / n;
      seconds = alpha_beta(1, (k - 1) * share, intra);
      if (spans) seconds = std::max(seconds, alpha_beta(1, (n - k) * share, inter));
      break;
    }
    case rt::TransferPattern::broadcast:
      if (n <= 1 || payload == 0) return 0;  // the chain's last member forwards nothing
      // A pipelined chain through the nodes in turn: n - nodes hops in a node, nodes - 1 across,
      // the buffer streaming at the pace of the slowest link it crosses.
      seconds = alpha_beta(n - nodes, 0, intra) + alpha_beta(nodes - 1, 0, inter) +
                payload / (spans ? std::min(intra.bytes_per_second, inter.bytes_per_second)
                                 : intra.bytes_per_second);
      break;
    case rt::TransferPattern::point_to_point:
      if (payload == 0) return 0;  // the receiver: the sender pays the transfer
      seconds = alpha_beta(1, payload, spans ? inter : intra);
      break;
    case rt::TransferPattern::barrier:
      if (n <= 1) return 0;
      // A dissemination barrier: ceil(log2 n) rounds, across the network when the group spans.
      seconds = alpha_beta(std::bit_width(static_cast<unsigned>(n - 1)), 0, spans ? inter : intra);
      break;
  }
  return static_cast<rt::Nanos>(std::llround(seconds * 1e9));
}

std::string Cluster::describe(int devices) const {
  auto one = [](const ClusterLink& l) {
    return fmt::format("{} ({:g} GB/s, {:g} us)", l.name, l.params.bytes_per_second * 1e-9,
                       static_cast<double>(l.params.latency) * 1e-3);
  };
  const int nodes = nodes_for(devices);
  return fmt::format("{} node{} x {} device{} ({} used); node link {}; network {} a device", nodes,
                     nodes == 1 ? "" : "s", devices_per_node_, devices_per_node_ == 1 ? "" : "s",
                     devices, one(node_link_), one(network_));
}

}  // namespace weave::devices
