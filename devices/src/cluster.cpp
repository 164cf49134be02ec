#include "weave/devices/cluster.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

#include "transfer_algorithms.hpp"

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

// At the bus bandwidth collectives reach on it, not its line rate; the name says which share of
// the line rate that is.
ClusterLink from_network_link(const NetworkLink& link) {
  return {.name = link.bus_efficiency < 1
                      ? fmt::format("{}, {:g} % of its {:g} GB/s as bus bandwidth", link.name,
                                    100 * link.bus_efficiency, link.bytes_per_second * 1e-9)
                      : link.name,
          .params = {.latency = static_cast<rt::Nanos>(std::llround(link.latency_us * 1e3)),
                     .bytes_per_second = link.bytes_per_second * link.bus_efficiency},
          .full_mesh = link.full_mesh};
}

// The patterns whose members exchange with every other member at once: over a full mesh each
// peer's share takes its own link.
bool exchanges_with_every_member(rt::TransferPattern pattern) {
  switch (pattern) {
    case rt::TransferPattern::all_reduce:
    case rt::TransferPattern::all_gather:
    case rt::TransferPattern::reduce_scatter:
    case rt::TransferPattern::all_to_all:
      return true;
    default:
      return false;
  }
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
  LinkParams intra = node_link_.params;
  if (node_link_.full_mesh && exchanges_with_every_member(pattern))
    intra.bytes_per_second *= std::max(1, group.per_node - 1);
  const double seconds =
      detail::transfer_algorithm(pattern).cluster_seconds(payload, group, intra, network_.params);
  return static_cast<rt::Nanos>(std::llround(seconds * 1e9));
}

std::string Cluster::describe(int devices) const {
  auto one = [](const ClusterLink& l) {
    return fmt::format("{} ({:g} GB/s{}, {:g} us)", l.name, l.params.bytes_per_second * 1e-9,
                       l.full_mesh ? " a link, a full mesh" : "",
                       static_cast<double>(l.params.latency) * 1e-3);
  };
  const int nodes = nodes_for(devices);
  return fmt::format("{} node{} x {} device{} ({} used); node link {}; network {} a device", nodes,
                     nodes == 1 ? "" : "s", devices_per_node_, devices_per_node_ == 1 ? "" : "s",
                     devices, one(node_link_), one(network_));
}

}  // namespace weave::devices
