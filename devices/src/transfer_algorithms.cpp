#include "transfer_algorithms.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>

namespace weave::devices::detail {

namespace {

using rt::TransferPattern;

// ------------------------------------------------------------------ the ring over one link

// The ring's per-member volume: (n-1)/n of `bytes`.
double ring_share(int n, double bytes) {
  return static_cast<double>(n - 1) / n * bytes;
}

double ring_all_reduce_bytes(int n, double payload) {  // a reduce-scatter then an all-gather
  return 2 * ring_share(n, payload);
}
double all_reduce_payload(int n, double bytes) {
  return bytes * n / (2.0 * (n - 1));
}
double ring_gather_payload(int n, double bytes) {
  return bytes * n / (n - 1);
}
double whole_payload(int, double bytes) {
  return bytes;
}
double no_bytes(int, double) {
  return 0.0;
}

std::uint32_t two_rounds(int n) {
  return static_cast<std::uint32_t>(2 * (n - 1));
}
std::uint32_t one_round(int n) {
  return static_cast<std::uint32_t>(n - 1);
}
std::uint32_t one_message(int) {
  return 1;
}
std::uint32_t no_messages(int) {
  return 0;
}
std::uint32_t dissemination_rounds(int n) {  // ceil(log2 n)
  return static_cast<std::uint32_t>(std::bit_width(static_cast<unsigned>(n - 1)));
}

bool every_member(int, int, int) {
  return true;
}
bool forwards_in_chain(int n, int member, int root) {  // a pipelined chain from the root
  return (member - root + n) % n < n - 1;
}
bool sender(int, int member, int) {
  return member == 0;
}

// ------------------------------------------------------------------ the algorithms on a cluster

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
  return alpha_beta(n - 1, ring_share(n, bytes), link);
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

double nothing_on_cluster(double, const GroupPlacement&, const LinkParams&, const LinkParams&) {
  return 0;
}

// One node: the faster of ring and tree over the node link. Across nodes (hierarchical):
// reduce-scatter inside the node, all-reduce of the node's 1/k share between the nodes' same
// local ranks (each over its own NIC), all-gather inside the node.
double all_reduce_on_cluster(double payload, const GroupPlacement& g, const LinkParams& intra,
                             const LinkParams& inter) {
  if (g.size <= 1) return 0;
  return g.nodes <= 1 ? best_all_reduce(g.size, payload, intra)
                      : ring_all_reduce(g.per_node, payload, intra) +
                            best_all_reduce(g.nodes, payload / g.per_node, inter);
}

// Ring inside the node; across nodes a ring between the nodes over 1/k of the buffer (each local
// rank's share) and a ring inside each node over the whole.
double gather_on_cluster(double payload, const GroupPlacement& g, const LinkParams& intra,
                         const LinkParams& inter) {
  if (g.size <= 1) return 0;
  return g.nodes <= 1 ? ring_gather(g.size, payload, intra)
                      : ring_gather(g.per_node, payload, intra) +
                            ring_gather(g.nodes, payload / g.per_node, inter);
}

// payload / n to each peer, every message in flight together: k - 1 peers over the node link,
// n - k over the member's NIC; the busier link, plus one latency, sets the time.
double all_to_all_on_cluster(double payload, const GroupPlacement& g, const LinkParams& intra,
                             const LinkParams& inter) {
  if (g.size <= 1) return 0;
  const double share = payload / g.size;
  double seconds = alpha_beta(1, (g.per_node - 1) * share, intra);
  if (g.nodes > 1) seconds = std::max(seconds, alpha_beta(1, (g.size - g.per_node) * share, inter));
  return seconds;
}

// A pipelined chain through the nodes in turn: n - nodes hops in a node, nodes - 1 across, the
// buffer streaming at the pace of the slowest link it crosses.
double broadcast_on_cluster(double payload, const GroupPlacement& g, const LinkParams& intra,
                            const LinkParams& inter) {
  if (g.size <= 1 || payload == 0) return 0;  // the chain's last member forwards nothing
  const bool spans = g.nodes > 1;
  return alpha_beta(g.size - g.nodes, 0, intra) + alpha_beta(g.nodes - 1, 0, inter) +
         payload / (spans ? std::min(intra.bytes_per_second, inter.bytes_per_second)
                          : intra.bytes_per_second);
}

// The node link inside a node, the network across.
double point_to_point_on_cluster(double payload, const GroupPlacement& g, const LinkParams& intra,
                                 const LinkParams& inter) {
  if (payload == 0) return 0;  // the receiver: the sender pays the transfer
  return alpha_beta(1, payload, g.nodes > 1 ? inter : intra);
}

// A dissemination barrier: ceil(log2 n) rounds, across the network when the group spans.
double barrier_on_cluster(double, const GroupPlacement& g, const LinkParams& intra,
                          const LinkParams& inter) {
  if (g.size <= 1) return 0;
  return alpha_beta(std::bit_width(static_cast<unsigned>(g.size - 1)), 0,
                    g.nodes > 1 ? inter : intra);
}

// ------------------------------------------------------------------ the table

constexpr std::array kAlgorithms{
    TransferAlgorithm{TransferPattern::none, no_bytes, whole_payload, no_messages, every_member,
                      nothing_on_cluster},
    TransferAlgorithm{TransferPattern::all_reduce, ring_all_reduce_bytes, all_reduce_payload,
                      two_rounds, every_member, all_reduce_on_cluster},
    TransferAlgorithm{TransferPattern::all_gather, ring_share, ring_gather_payload, one_round,
                      every_member, gather_on_cluster},
    TransferAlgorithm{TransferPattern::reduce_scatter, ring_share, ring_gather_payload, one_round,
                      every_member, gather_on_cluster},
    TransferAlgorithm{TransferPattern::all_to_all, ring_share, ring_gather_payload, one_round,
                      every_member, all_to_all_on_cluster},
    TransferAlgorithm{TransferPattern::broadcast, whole_payload, whole_payload, one_round,
                      forwards_in_chain, broadcast_on_cluster},
    TransferAlgorithm{TransferPattern::point_to_point, whole_payload, whole_payload, one_message,
                      sender, point_to_point_on_cluster},
    TransferAlgorithm{TransferPattern::barrier, no_bytes, whole_payload, dissemination_rounds,
                      every_member, barrier_on_cluster},
};

constexpr bool in_pattern_order() {
  for (std::size_t i = 0; i < kAlgorithms.size(); ++i)
    if (static_cast<std::size_t>(kAlgorithms[i].pattern) != i) return false;
  return kAlgorithms.size() == static_cast<std::size_t>(TransferPattern::barrier) + 1;
}
static_assert(in_pattern_order(), "one algorithm entry per transfer pattern, in enum order");

}  // namespace

const TransferAlgorithm& transfer_algorithm(rt::TransferPattern pattern) {
  return kAlgorithms[static_cast<std::size_t>(pattern)];
}

}  // namespace weave::devices::detail
