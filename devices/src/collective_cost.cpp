// The cost hints of collective members: the ring algorithm's bytes per member and its latency
// terms, the same for every backend.
#include <bit>
#include <span>
#include <string_view>

#include "weave/devices/collective.hpp"

namespace weave::devices {

namespace {

// The ring algorithm's per-member volume: (n-1)/n of `bytes`.
double ring_share(int n, double bytes) {
  return static_cast<double>(n - 1) / n * bytes;
}

// A cost that only groups of more than one member pay.
rt::CostHint group_cost(int n, double bytes, int messages) {
  if (n <= 1) return {};
  return {.bytes = bytes, .messages = static_cast<std::uint32_t>(messages)};
}

}  // namespace

std::string_view to_string(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::all_reduce:
      return "all_reduce";
    case CollectiveOp::all_gather:
      return "all_gather";
    case CollectiveOp::reduce_scatter:
      return "reduce_scatter";
    case CollectiveOp::all_to_all:
      return "all_to_all";
    case CollectiveOp::all_to_all_v:
      return "all_to_all_v";
    case CollectiveOp::all_gather_v:
      return "all_gather_v";
    case CollectiveOp::reduce_scatter_v:
      return "reduce_scatter_v";
    case CollectiveOp::broadcast:
      return "broadcast";
    case CollectiveOp::send_recv:
      return "send_recv";
    case CollectiveOp::barrier:
      return "barrier";
  }
  return "collective";
}

namespace {

// The ring's bytes and latency terms of member `member` (of n).
rt::CostHint ring_cost(CollectiveOp op, int n, int member, int root,
                       const CollectiveMember& buffers, std::int64_t row_elements,
                       double element_bytes) {
  // `elements` values of the run's element size (4, or 2 in a 16-bit prediction; the buffers
  // themselves always hold floats).
  auto bytes_of = [element_bytes](auto elements) {
    return static_cast<double>(elements) * element_bytes;
  };
  switch (op) {
    case CollectiveOp::all_reduce:  // a reduce-scatter then an all-gather
      return group_cost(n, 2 * ring_share(n, bytes_of(buffers.output.size())), 2 * (n - 1));
    case CollectiveOp::all_gather:  // every member receives the n - 1 other shards
      return group_cost(n, ring_share(n, bytes_of(buffers.input.size() * n)), n - 1);
    case CollectiveOp::reduce_scatter:
      return group_cost(n, ring_share(n, bytes_of(buffers.output.size() * n)), n - 1);
    case CollectiveOp::all_to_all:
      return group_cost(n, ring_share(n, bytes_of(buffers.input.size())), n - 1);
    case CollectiveOp::all_to_all_v: {
      // The split is unknown until run time: the hint costs the member's expected rows (or its
      // whole send buffer) spread evenly over the ranks; the member reports the real split.
      const VariableAllToAllBuffers& v = buffers.variable;
      const std::size_t elements = v.expected_rows > 0
                                       ? static_cast<std::size_t>(v.expected_rows * row_elements)
                                       : v.send.size();
      return {.bytes = n > 1 ? ring_share(n, bytes_of(elements)) : 0.0,
              .messages = static_cast<std::uint32_t>(n - 1)};
    }
    case CollectiveOp::all_gather_v: {  // like all_gather, for the expected rows per member
      const VariableGatherBuffers& g = buffers.gather;
      const double elements = g.expected_rows > 0
                                  ? static_cast<double>(g.expected_rows * row_elements * n)
                                  : static_cast<double>(g.recv.size());
      return group_cost(n, ring_share(n, bytes_of(elements)), n - 1);
    }
    case CollectiveOp::reduce_scatter_v: {
      const VariableScatterBuffers& s = buffers.scatter;
      const double elements = s.expected_rows > 0
                                  ? static_cast<double>(s.expected_rows * row_elements * n)
                                  : static_cast<double>(s.recv.size() * n);
      return group_cost(n, ring_share(n, bytes_of(elements)), n - 1);
    }
    case CollectiveOp::broadcast:  // a pipelined chain from the root: all but the last forward
      if ((member - root + n) % n < n - 1)
        return {.bytes = bytes_of(buffers.output.size()),
                .messages = static_cast<std::uint32_t>(n - 1)};
      return {};
    case CollectiveOp::send_recv:  // the sender pays the transfer
      if (member == 0) return {.bytes = bytes_of(buffers.input.size()), .messages = 1};
      return {};
    case CollectiveOp::barrier:  // a dissemination barrier: ceil(log2 n) rounds of messages
      return group_cost(n, 0.0, std::bit_width(static_cast<unsigned>(n - 1)));
  }
  return {};
}

// The transfer pattern `op` follows.
rt::TransferPattern pattern_of(CollectiveOp op) {
  using P = rt::TransferPattern;
  switch (op) {
    case CollectiveOp::all_reduce:
      return P::all_reduce;
    case CollectiveOp::all_gather:
    case CollectiveOp::all_gather_v:
      return P::all_gather;
    case CollectiveOp::reduce_scatter:
    case CollectiveOp::reduce_scatter_v:
      return P::reduce_scatter;
    case CollectiveOp::all_to_all:
    case CollectiveOp::all_to_all_v:
      return P::all_to_all;
    case CollectiveOp::broadcast:
      return P::broadcast;
    case CollectiveOp::send_recv:
      return P::point_to_point;
    case CollectiveOp::barrier:
      return P::barrier;
  }
  return P::none;
}

}  // namespace

rt::CostHint member_cost(CollectiveOp op, const ProcessGroup& group, int member, int root,
                         const CollectiveMember& buffers, std::int64_t row_elements,
                         std::size_t element_bytes) {
  const int n = group.size();
  rt::CostHint cost =
      ring_cost(op, n, member, root, buffers, row_elements, static_cast<double>(element_bytes));
  cost.pattern = pattern_of(op);
  cost.group_size = static_cast<std::uint32_t>(n);
  cost.group_first_device = group.device(0);
  // Evenly spaced devices (every group of the mesh is) are told by their first and stride.
  cost.group_device_stride = group.device_stride();
  return cost;
}

}  // namespace weave::devices
