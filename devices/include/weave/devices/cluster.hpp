// A cluster of nodes, each holding devices_per_node devices joined by a node link (NVLink,
// HCCS), the nodes joined by a network (InfiniBand, RoCE) in which every device has its own
// NIC. Devices map to nodes by global rank: rank r sits on node r / devices_per_node (Megatron's
// rank order puts tensor parallelism fastest, so small tp groups stay inside a node).
//
// A collective is costed by the algorithm its group would use where it sits:
//   - inside one node, over the node link: ring, or for an all-reduce the faster of ring and
//     double binary tree (NCCL's tuner picks per size from the same two estimates, roughly);
//   - spanning nodes: hierarchical, as NCCL's and HCCL's multi-node algorithms are (intra-node
//     reduce-scatter, an all-reduce between the same local ranks of each node over their own
//     NICs, intra-node all-gather; all-gather and reduce-scatter likewise in two levels);
//   - all-to-all with every message in flight at once: the largest volume any one link of the
//     member carries (node link or NIC) over that link's bandwidth, plus one latency;
//   - point to point: the node link inside a node, the network across.
// A node link that is a full mesh (every device joined to each other one by a link of its own,
// as HCCS joins the 8 chips of an Atlas 800T A2) gives one link's figures: HCCL runs a node's
// collectives there by its Mesh algorithm, each member exchanging with every other at once, so
// an all-reduce, all-gather, reduce-scatter or all-to-all among k devices of a node moves over
// k - 1 links together (the formulas above with k - 1 times the link's bandwidth); point to
// point and the broadcast's chain use one link.
// The closed forms are in the transfer patterns' table (devices/src/transfer_algorithms.cpp),
// beside each pattern's ring over one link, and checked in tests/devices/cluster_test.cpp.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weave/devices/accelerator.hpp"
#include "weave/devices/link_model.hpp"
#include "weave/runtime/types.hpp"

namespace weave::devices {

struct ClusterLink {
  std::string name;
  LinkParams params;  // per device: a node link's share, or the device's NIC
  // A node link only: params are one link's of a full mesh (NetworkLink::full_mesh).
  bool full_mesh = false;
};

// Where a collective's group sits: how many nodes it spans and how many of its members share
// a node (the most on any one node; a group spread unevenly is costed as if every node held
// that many, its busiest node setting the pace).
struct GroupPlacement {
  int size = 1;
  int nodes = 1;
  int per_node = 1;
};

// What the cluster flags (--devices-per-node, --node-link, --network) override of an
// accelerator preset's node, or give without one. Unset fields keep the preset's.
struct ClusterOverrides {
  int devices_per_node = 0;  // 0: not given
  std::string node_link;     // "GBPS:MICROSECONDS" or "": a device's share, never a full mesh
  std::string network;       // "GBPS:MICROSECONDS" or ""
  bool any() const { return devices_per_node != 0 || !node_link.empty() || !network.empty(); }
};

class Cluster {
 public:
  // Throws std::invalid_argument for devices_per_node outside [1, 10^6] or a link whose
  // bandwidth is not positive or whose latency is negative.
  Cluster(int devices_per_node, ClusterLink node_link, ClusterLink network);

  // The node an accelerator preset describes, its figures replaced by the overrides given.
  static Cluster from_accelerator(const Accelerator& accelerator,
                                  const ClusterOverrides& overrides = {});
  // Without an accelerator every figure must be given: throws std::invalid_argument naming the
  // missing flag, or a value that breaks its rule, and how to fix it.
  static Cluster from_overrides(const ClusterOverrides& overrides);
  // "GBPS:MICROSECONDS" as a link's figures; `flag` names the option in the error message.
  static LinkParams parse_link(std::string_view spec, std::string_view flag);

  int devices_per_node() const { return devices_per_node_; }
  const ClusterLink& node_link() const { return node_link_; }
  const ClusterLink& network() const { return network_; }
  int node_of(std::uint32_t global_rank) const {
    return static_cast<int>(global_rank / static_cast<std::uint32_t>(devices_per_node_));
  }
  int nodes_for(int devices) const { return (devices + devices_per_node_ - 1) / devices_per_node_; }
  // Nodes spanned and members per node of the group first, first + stride, ... (size members).
  GroupPlacement place(std::uint32_t first, std::uint32_t stride, int size) const;
  // The same for any set of global ranks, each listed once.
  GroupPlacement place(std::vector<std::uint32_t> ranks) const;

  // How long a member of a collective of `pattern` over a group placed so takes, moving
  // `payload_bytes` as rt::TransferPattern defines it. The group lasts as long as its slowest
  // member; every member here is given the whole algorithm's time.
  rt::Nanos collective_duration(rt::TransferPattern pattern, double payload_bytes,
                                const GroupPlacement& group) const;

  // "2 nodes x 8 devices (16 used); node link NVLink (450 GB/s, 3 us); network IB (50 GB/s,
  // 5 us) a device"
  std::string describe(int devices) const;

 private:
  int devices_per_node_;
  ClusterLink node_link_;
  ClusterLink network_;
};

}  // namespace weave::devices
