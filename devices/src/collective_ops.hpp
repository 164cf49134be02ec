// The collective operations, one entry per CollectiveOp, as ggml and NCCL keep an operation: its
// name, the transfer pattern it follows (whose algorithms price it, over one link and over a
// cluster: transfer_algorithms.hpp), and the payload a member moves, read from the member's own
// buffers (CollectiveMember says which buffers each op uses). member_cost prices a member from
// these alone. Each backend implements every op in a table of its own, kept in this table's
// order (lists_every_op), so an op missing from a backend does not compile.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "weave/devices/collective.hpp"

namespace weave::devices::detail {

struct CollectiveOpEntry {
  CollectiveOp op;
  std::string_view name;
  rt::TransferPattern pattern;
  // The elements of the pattern's payload that member `buffers` moves, over a group of n (rows
  // of row_elements for the variable ops, at their expected counts).
  double (*payload_elements)(const CollectiveMember& buffers, int n, std::int64_t row_elements);
};

inline constexpr std::size_t kCollectiveOpCount =
    static_cast<std::size_t>(CollectiveOp::barrier) + 1;

const CollectiveOpEntry& collective_op(CollectiveOp op);

// Whether `table` (entries with a member `op`) has one entry per op, in CollectiveOp's order, so
// that it can be indexed by op.
template <typename Entry, std::size_t N>
constexpr bool lists_every_op(const std::array<Entry, N>& table) {
  if (N != kCollectiveOpCount) return false;
  for (std::size_t i = 0; i < N; ++i)
    if (table[i].op != static_cast<CollectiveOp>(i)) return false;
  return true;
}

}  // namespace weave::devices::detail
