// The table of collective operations and the cost hints of their members, the same for every
// backend.
#include "collective_ops.hpp"

#include "transfer_algorithms.hpp"

namespace weave::devices {

namespace detail {

namespace {

using P = rt::TransferPattern;

// Each op's payload in elements (see transfer_algorithms.hpp for what each pattern's payload is).

double buffer(const CollectiveMember& m, int, std::int64_t) {  // all_reduce, broadcast: in place
  return static_cast<double>(m.output.size());
}
double gathered(const CollectiveMember& m, int n, std::int64_t) {  // n shards of the input
  return static_cast<double>(m.input.size() * n);
}
double scattered(const CollectiveMember& m, int n, std::int64_t) {  // n blocks of the output
  return static_cast<double>(m.output.size() * n);
}
double sent(const CollectiveMember& m, int, std::int64_t) {  // all_to_all, send_recv's sender
  return static_cast<double>(m.input.size());
}
double nothing(const CollectiveMember&, int, std::int64_t) {
  return 0.0;
}

// The variable ops' split is unknown until run time: the hint costs the member's expected rows
// (or its whole buffer); the member reports the real split when it runs.
double sent_rows(const CollectiveMember& m, int, std::int64_t row_elements) {
  const VariableAllToAllBuffers& v = m.variable;
  return static_cast<double>(v.expected_rows > 0
                                 ? static_cast<std::size_t>(v.expected_rows * row_elements)
                                 : v.send.size());
}
double gathered_rows(const CollectiveMember& m, int n, std::int64_t row_elements) {
  const VariableGatherBuffers& g = m.gather;
  return g.expected_rows > 0 ? static_cast<double>(g.expected_rows * row_elements * n)
                             : static_cast<double>(g.recv.size());
}
double scattered_rows(const CollectiveMember& m, int n, std::int64_t row_elements) {
  const VariableScatterBuffers& s = m.scatter;
  return s.expected_rows > 0 ? static_cast<double>(s.expected_rows * row_elements * n)
                             : static_cast<double>(s.recv.size() * n);
}

constexpr std::array kOps{
    CollectiveOpEntry{CollectiveOp::all_reduce, "all_reduce", P::all_reduce, buffer},
    CollectiveOpEntry{CollectiveOp::all_gather, "all_gather", P::all_gather, gathered},
    CollectiveOpEntry{CollectiveOp::reduce_scatter, "reduce_scatter", P::reduce_scatter, scattered},
    CollectiveOpEntry{CollectiveOp::all_to_all, "all_to_all", P::all_to_all, sent},
    CollectiveOpEntry{CollectiveOp::all_to_all_v, "all_to_all_v", P::all_to_all, sent_rows},
    CollectiveOpEntry{CollectiveOp::all_gather_v, "all_gather_v", P::all_gather, gathered_rows},
    CollectiveOpEntry{CollectiveOp::reduce_scatter_v, "reduce_scatter_v", P::reduce_scatter,
                      scattered_rows},
    CollectiveOpEntry{CollectiveOp::broadcast, "broadcast", P::broadcast, buffer},
    CollectiveOpEntry{CollectiveOp::send_recv, "send_recv", P::point_to_point, sent},
    CollectiveOpEntry{CollectiveOp::barrier, "barrier", P::barrier, nothing},
};
static_assert(lists_every_op(kOps), "one entry per collective op, in CollectiveOp's order");

}  // namespace

const CollectiveOpEntry& collective_op(CollectiveOp op) {
  return kOps[static_cast<std::size_t>(op)];
}

}  // namespace detail

std::string_view to_string(CollectiveOp op) {
  return static_cast<std::size_t>(op) < detail::kCollectiveOpCount ? detail::collective_op(op).name
                                                                   : "collective";
}

rt::CostHint member_cost(CollectiveOp op, const ProcessGroup& group, int member, int root,
                         const CollectiveMember& buffers, std::int64_t row_elements,
                         std::size_t element_bytes) {
  const detail::CollectiveOpEntry& entry = detail::collective_op(op);
  const detail::TransferAlgorithm& algorithm = detail::transfer_algorithm(entry.pattern);
  const int n = group.size();
  rt::CostHint cost;
  // A group of one moves nothing; in a larger one, the members the pattern makes pay move the
  // ring's bytes for their payload at the run's element size (4, or 2 in a 16-bit prediction;
  // the buffers themselves always hold floats).
  if (n > 1 && algorithm.pays(n, member, root)) {
    const double payload =
        entry.payload_elements(buffers, n, row_elements) * static_cast<double>(element_bytes);
    cost.bytes = algorithm.ring_bytes(n, payload);
    cost.messages = algorithm.ring_messages(n);
  }
  cost.pattern = entry.pattern;
  cost.group_size = static_cast<std::uint32_t>(n);
  cost.group_first_device = group.device(0);
  // Evenly spaced devices (every group of the mesh is) are told by their first and stride.
  cost.group_device_stride = group.device_stride();
  return cost;
}

}  // namespace weave::devices
