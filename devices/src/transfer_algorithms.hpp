// How each transfer pattern moves its payload, one entry per rt::TransferPattern, as NCCL's
// tuner keeps each collective's algorithms with their cost: over one link as a ring (the bytes
// and latency terms a member's rt::CostHint carries, which a LinkModel prices), and over a
// cluster by the algorithm the group's placement calls for (Cluster::collective_duration).
//
// The payload a pattern moves (what CollectiveOps' payload reads from a member's buffers):
//   all_reduce      the buffer reduced
//   all_gather      the gathered output
//   reduce_scatter  the input before scattering
//   all_to_all      the member's send buffer
//   broadcast       the buffer
//   point_to_point  the message
//   barrier         nothing
// The ring's bytes per member are the payload times the ring factor (ring_bytes); a cost model
// that needs the payload back from a hint's bytes (or from the bytes a member reported when it
// ran) reads it with payload_of_ring_bytes, the same entry's inverse.
#pragma once

#include <cstdint>

#include "weave/devices/cluster.hpp"
#include "weave/runtime/types.hpp"

namespace weave::devices::detail {

struct TransferAlgorithm {
  rt::TransferPattern pattern;
  // The ring over one link, for a group of n > 1: the bytes a paying member moves for `payload`
  // (n - 1 steps of payload / n for a gather, twice that for an all-reduce), the payload such
  // bytes carry, and the latency terms (alpha) the member pays.
  double (*ring_bytes)(int n, double payload);
  double (*payload_of_ring_bytes)(int n, double bytes);
  std::uint32_t (*ring_messages)(int n);
  // Whether member `member` of n pays the transfer: every member, but a broadcast's chain ends
  // at a member that forwards nothing, and a point-to-point transfer is paid by its sender.
  bool (*pays)(int n, int member, int root);
  // Seconds a member of a group placed so takes on a cluster whose node link and network are
  // given (each device's share of the one, its own NIC of the other).
  double (*cluster_seconds)(double payload, const GroupPlacement& group,
                            const LinkParams& node_link, const LinkParams& network);
};

const TransferAlgorithm& transfer_algorithm(rt::TransferPattern pattern);

}  // namespace weave::devices::detail
