#include "weave/devices/shared_memory_communicator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <functional>
#include <stdexcept>
#include <string>

#include "collective_kernels.hpp"
#include "collective_ops.hpp"

namespace weave::devices {

namespace {

constexpr std::size_t bytes_of(std::size_t elements) {
  return elements * sizeof(float);
}

// Shares are whole cache lines (of 64-byte aligned buffers), so two members never write the
// same line.
constexpr std::size_t kLineElements = 64 / sizeof(float);

// [first, last) of `count` elements that rank r of n reduces: an even split of the lines, the
// remainder spread over the first ranks, the last line clipped to count.
std::pair<std::size_t, std::size_t> share(std::size_t count, int n, int r) {
  const std::size_t lines = (count + kLineElements - 1) / kLineElements;
  const auto un = static_cast<std::size_t>(n), ur = static_cast<std::size_t>(r);
  const std::size_t base = lines / un, extra = lines % un;
  const std::size_t first = (ur * base + std::min(ur, extra)) * kLineElements;
  const std::size_t last = first + (base + (ur < extra ? 1 : 0)) * kLineElements;
  return {std::min(first, count), std::min(last, count)};
}

// Whether a collective touching this many bytes in all (read and written) should write past
// the caches.
bool streams(std::size_t footprint) {
  return footprint >= detail::kStreamingBytes;
}

// Every rank's buffer chosen by `pick` must hold `expected` elements, for the reason `rule`.
template <typename Pick>
void check_sizes(const Collective& c, Pick pick, std::size_t expected, const char* what,
                 const std::string& rule) {
  const ProcessGroup& g = c.group;
  for (int r = 0; r < g.size(); ++r) {
    const std::size_t size = pick(c.members[static_cast<std::size_t>(r)]).size();
    if (size != expected)
      throw std::invalid_argument(
          fmt::format("{} over group '{}': rank {} (device {}) has an {} of {} elements where {} "
                      "are needed ({}); size every rank's buffers alike",
                      to_string(c.call.op), g.name(), r, g.device(r), what, size, expected, rule));
  }
}

auto inputs_of = [](const CollectiveMember& m) { return m.input; };
auto outputs_of = [](const CollectiveMember& m) { return m.output; };

std::vector<const float*> input_pointers(const Collective& c) {
  std::vector<const float*> p;
  for (const CollectiveMember& m : c.members)
    p.push_back(m.input.data());
  return p;
}

std::vector<float*> output_pointers(const Collective& c) {
  std::vector<float*> p;
  for (const CollectiveMember& m : c.members)
    p.push_back(m.output.data());
  return p;
}

// Each op's plan: checks the sizes, returns member r's share of the transfer.

MemberWork plan_all_reduce(const Collective& c) {
  const int n = c.group.size();
  const std::size_t count = c.members[0].output.size();
  check_sizes(c, outputs_of, count, "input/output buffer",
              fmt::format("every rank reduces a buffer of rank 0's size, {} elements", count));
  if (n == 1) return {};
  const std::vector<float*> data = output_pointers(c);
  const std::vector<const float*> sources(data.begin(), data.end());
  const ReduceOp op = c.call.reduce;
  // Member r reduces its share of every rank's buffer and writes the result to every rank's
  // buffer. In place and still race-free: only member r touches its share, and the kernel
  // reads each element from every rank before writing it. Regular stores beat streaming ones
  // here: the lines written were just read, so they are already cached.
  return [=](int r, rt::TaskContext&) {
    const auto [first, last] = share(count, n, r);
    detail::reduce_to_all(op, sources, first, data, first, last - first, false);
  };
}

MemberWork plan_all_gather(const Collective& c) {
  const int n = c.group.size();
  const std::size_t m = c.members[0].input.size();
  check_sizes(c, inputs_of, m, "input",
              fmt::format("every rank contributes rank 0's {} elements", m));
  check_sizes(c, outputs_of, m * n, "output",
              fmt::format("each output holds group size x input = {} x {}", n, m));
  const std::vector<const float*> in = input_pointers(c);
  const std::vector<float*> out = output_pointers(c);
  const bool streaming = streams(bytes_of(m * n * (n + 1)));
  // Member r pushes its shard into every output: it reads the shard once, whatever n is.
  return [=](int r, rt::TaskContext&) {
    const std::span<const float* const> shard(&in[r], 1);
    detail::reduce_to_all(ReduceOp::sum, shard, 0, out, static_cast<std::size_t>(r) * m, m,
                          streaming);
  };
}

MemberWork plan_reduce_scatter(const Collective& c) {
  const int n = c.group.size();
  const std::size_t m = c.members[0].output.size();
  check_sizes(c, outputs_of, m, "output",
              fmt::format("every rank receives rank 0's {} elements", m));
  check_sizes(c, inputs_of, m * n, "input",
              fmt::format("each input holds group size x output = {} x {}", n, m));
  const std::vector<const float*> in = input_pointers(c);
  const std::vector<float*> out = output_pointers(c);
  const bool streaming = streams(bytes_of(m * n * (n + 1)));
  const ReduceOp op = c.call.reduce;
  // Member r reduces block r of every input into its own output.
  return [=](int r, rt::TaskContext&) {
    const std::span<float* const> mine(&out[r], 1);
    detail::reduce_to_all(op, in, static_cast<std::size_t>(r) * m, mine, 0, m, streaming);
  };
}

MemberWork plan_all_to_all(const Collective& c) {
  const int n = c.group.size();
  const std::size_t total = c.members[0].input.size();
  if (total % static_cast<std::size_t>(n) != 0)
    throw std::invalid_argument(
        fmt::format("all_to_all over group '{}': rank 0's {} elements cannot be split into {} "
                    "equal blocks, one per rank; pad them to a multiple of {} or use all_to_all_v",
                    c.group.name(), total, n, n));
  const std::string rule = fmt::format("every rank sends and receives {} blocks of {} elements", n,
                                       total / static_cast<std::size_t>(n));
  check_sizes(c, inputs_of, total, "input", rule);
  check_sizes(c, outputs_of, total, "output", rule);
  const std::size_t m = total / static_cast<std::size_t>(n);
  const std::vector<const float*> in = input_pointers(c);
  const std::vector<float*> out = output_pointers(c);
  const bool streaming = streams(2 * bytes_of(total * n));
  // Member r pulls its block from every input.
  return [=](int r, rt::TaskContext&) {
    for (int j = 0; j < n; ++j)
      detail::copy_floats(out[r] + static_cast<std::size_t>(j) * m,
                          in[j] + static_cast<std::size_t>(r) * m, m, streaming);
  };
}

MemberWork plan_all_to_all_v(const Collective& c) {
  const int n = c.group.size();
  const ProcessGroup& group = c.group;
  if (c.call.row_elements < 1)
    throw std::invalid_argument(fmt::format(
        "all_to_all_v over group '{}': a row must hold at least 1 element, got {}; pass the "
        "number of floats per token row",
        group.name(), c.call.row_elements));
  std::vector<VariableAllToAllBuffers> b;
  for (int r = 0; r < n; ++r) {
    const VariableAllToAllBuffers& v = c.members[static_cast<std::size_t>(r)].variable;
    if (!v.send_counts)
      throw std::invalid_argument(
          fmt::format("all_to_all_v over group '{}': rank {} (device {}) has no send_counts; "
                      "point it at the vector an earlier task fills",
                      group.name(), r, group.device(r)));
    if (v.recv_counts.size() != static_cast<std::size_t>(n))
      throw std::invalid_argument(
          fmt::format("all_to_all_v over group '{}': rank {} (device {}) has room for {} receive "
                      "counts; give it one per rank, {}",
                      group.name(), r, group.device(r), v.recv_counts.size(), n));
    b.push_back(v);
  }
  const auto row = static_cast<std::size_t>(c.call.row_elements);
  const std::string group_name = group.name();
  return [=](int r, rt::TaskContext& context) {
    // Every member's counts are final here: the rendezvous started no member's transfer before
    // all had arrived, so the tasks that filled them have completed. Each member checks every
    // sender it reads from, so a bad count fails the run before anything is copied from it.
    for (int j = 0; j < n; ++j) {
      const std::vector<std::int64_t>& counts = *b[j].send_counts;
      if (counts.size() != static_cast<std::size_t>(n))
        throw std::runtime_error(fmt::format(
            "all_to_all_v over group '{}': rank {} has {} send counts, needs one per rank ({})",
            group_name, j, counts.size(), n));
      std::size_t rows = 0;
      for (std::int64_t k : counts) {
        if (k < 0)
          throw std::runtime_error(fmt::format(
              "all_to_all_v over group '{}': rank {} sends a negative count {}", group_name, j, k));
        rows += static_cast<std::size_t>(k);
      }
      if (rows * row > b[j].send.size())
        throw std::runtime_error(fmt::format(
            "all_to_all_v over group '{}': rank {} sends {} rows of {} elements but its send "
            "buffer holds {} elements",
            group_name, j, rows, row, b[j].send.size()));
    }
    std::size_t total = 0;
    for (int j = 0; j < n; ++j)
      total += static_cast<std::size_t>((*b[j].send_counts)[r]) * row;
    if (total > b[r].recv.size())
      throw std::runtime_error(fmt::format(
          "all_to_all_v over group '{}': rank {} receives {} elements but its receive buffer "
          "holds {}; size it for the largest possible split (dropless MoE: tokens x top-k rows)",
          group_name, r, total, b[r].recv.size()));
    const bool streaming = streams(2 * bytes_of(total) * static_cast<std::size_t>(n));
    std::size_t at = 0;
    for (int j = 0; j < n; ++j) {
      const std::vector<std::int64_t>& counts = *b[j].send_counts;
      std::size_t from = 0;
      for (int k = 0; k < r; ++k)
        from += static_cast<std::size_t>(counts[k]) * row;
      const std::size_t len = static_cast<std::size_t>(counts[r]) * row;
      detail::copy_floats(b[r].recv.data() + at, b[j].send.data() + from, len, streaming);
      b[r].recv_counts[j] = counts[r];
      at += len;
    }
    // Timed by the real split: the larger of what this member sends to and receives from the
    // other ranks (the hint assumed its whole send buffer).
    std::size_t sent = 0, received = 0;
    for (int j = 0; j < n; ++j) {
      if (j == r) continue;
      sent += static_cast<std::size_t>((*b[r].send_counts)[j]) * row;
      received += static_cast<std::size_t>((*b[j].send_counts)[r]) * row;
    }
    context.report_cost({.bytes = static_cast<double>(bytes_of(std::max(sent, received))),
                         .messages = static_cast<std::uint32_t>(n - 1)});
  };
}

// The row size of a variable collective, checked.
std::size_t row_size(const Collective& c) {
  if (c.call.row_elements < 1)
    throw std::invalid_argument(fmt::format(
        "{} over group '{}': a row must hold at least 1 element, got {}; pass the number of "
        "floats per token row",
        to_string(c.call.op), c.group.name(), c.call.row_elements));
  return static_cast<std::size_t>(c.call.row_elements);
}

MemberWork plan_all_gather_v(const Collective& c) {
  const int n = c.group.size();
  const ProcessGroup& group = c.group;
  const std::size_t row = row_size(c);
  std::vector<VariableGatherBuffers> b;
  for (int r = 0; r < n; ++r) {
    const VariableGatherBuffers& g = c.members[static_cast<std::size_t>(r)].gather;
    if (!g.send_rows)
      throw std::invalid_argument(
          fmt::format("all_gather_v over group '{}': rank {} (device {}) has no send_rows; point "
                      "it at the count an earlier task sets",
                      group.name(), r, group.device(r)));
    if (g.recv_rows.size() != static_cast<std::size_t>(n))
      throw std::invalid_argument(
          fmt::format("all_gather_v over group '{}': rank {} (device {}) has room for {} receive "
                      "counts; give it one per rank, {}",
                      group.name(), r, group.device(r), g.recv_rows.size(), n));
    b.push_back(g);
  }
  const std::string group_name = group.name();
  return [=](int r, rt::TaskContext& context) {
    // Every member's count is final: the rendezvous started none before all had arrived.
    std::size_t total = 0;
    for (int j = 0; j < n; ++j) {
      const std::int64_t rows = *b[j].send_rows;
      if (rows < 0 || static_cast<std::size_t>(rows) * row > b[j].send.size())
        throw std::runtime_error(fmt::format(
            "all_gather_v over group '{}': rank {} sends {} rows of {} elements but its send "
            "buffer holds {} elements",
            group_name, j, rows, row, b[j].send.size()));
      total += static_cast<std::size_t>(rows) * row;
    }
    if (total > b[r].recv.size())
      throw std::runtime_error(fmt::format(
          "all_gather_v over group '{}': rank {} receives {} elements but its receive buffer "
          "holds {}; size it for every rank's largest block",
          group_name, r, total, b[r].recv.size()));
    const bool streaming = streams(2 * bytes_of(total));
    std::size_t at = 0, received = 0;
    for (int j = 0; j < n; ++j) {
      const std::size_t len = static_cast<std::size_t>(*b[j].send_rows) * row;
      detail::copy_floats(b[r].recv.data() + at, b[j].send.data(), len, streaming);
      b[r].recv_rows[j] = *b[j].send_rows;
      at += len;
      if (j != r) received += len;
    }
    context.report_cost({.bytes = static_cast<double>(bytes_of(received)),
                         .messages = static_cast<std::uint32_t>(n - 1)});
  };
}

MemberWork plan_reduce_scatter_v(const Collective& c) {
  const int n = c.group.size();
  const ProcessGroup& group = c.group;
  const std::size_t row = row_size(c);
  std::vector<VariableScatterBuffers> b;
  for (int r = 0; r < n; ++r) {
    const VariableScatterBuffers& s = c.members[static_cast<std::size_t>(r)].scatter;
    if (!s.rows)
      throw std::invalid_argument(
          fmt::format("reduce_scatter_v over group '{}': rank {} (device {}) has no block rows; "
                      "point it at the counts an earlier task sets",
                      group.name(), r, group.device(r)));
    b.push_back(s);
  }
  const std::string group_name = group.name();
  const ReduceOp op = c.call.reduce;
  return [=](int r, rt::TaskContext& context) {
    const std::vector<std::int64_t>& rows = *b[r].rows;
    if (rows.size() != static_cast<std::size_t>(n))
      throw std::runtime_error(
          fmt::format("reduce_scatter_v over group '{}': rank {} has {} block counts, needs one "
                      "per rank ({})",
                      group_name, r, rows.size(), n));
    std::size_t total = 0, first = 0;
    for (int j = 0; j < n; ++j) {
      if (rows[j] < 0)
        throw std::runtime_error(
            fmt::format("reduce_scatter_v over group '{}': rank {} has a negative block count {}",
                        group_name, r, rows[j]));
      if (j < r) first += static_cast<std::size_t>(rows[j]) * row;
      total += static_cast<std::size_t>(rows[j]) * row;
    }
    for (int j = 0; j < n; ++j) {
      if (*b[j].rows != rows)
        throw std::runtime_error(fmt::format(
            "reduce_scatter_v over group '{}': ranks {} and {} disagree on the blocks' rows; "
            "every member must pass the same counts",
            group_name, r, j));
      if (total > b[j].send.size())
        throw std::runtime_error(fmt::format(
            "reduce_scatter_v over group '{}': the blocks hold {} elements but rank {}'s send "
            "buffer holds {}",
            group_name, total, j, b[j].send.size()));
    }
    const std::size_t mine = static_cast<std::size_t>(rows[r]) * row;
    if (mine > b[r].recv.size())
      throw std::runtime_error(fmt::format(
          "reduce_scatter_v over group '{}': rank {} receives {} elements but its receive buffer "
          "holds {}",
          group_name, r, mine, b[r].recv.size()));
    std::vector<const float*> sources;
    for (int j = 0; j < n; ++j)
      sources.push_back(b[j].send.data());
    float* const out = b[r].recv.data();
    detail::reduce_to_all(op, sources, first, std::span<float* const>(&out, 1), 0, mine,
                          streams(bytes_of(mine) * static_cast<std::size_t>(n + 1)));
    context.report_cost({.bytes = static_cast<double>(bytes_of(mine * (n - 1))),
                         .messages = static_cast<std::uint32_t>(n - 1)});
  };
}

MemberWork plan_broadcast(const Collective& c) {
  const int n = c.group.size();
  const int root = c.call.root;
  if (root < 0 || root >= n)
    throw std::invalid_argument(
        fmt::format("broadcast over group '{}': root rank {} is outside [0, {}); name the root "
                    "by its rank in the group, not its device",
                    c.group.name(), root, n));
  const std::size_t count = c.members[static_cast<std::size_t>(root)].output.size();
  check_sizes(c, outputs_of, count, "input/output buffer",
              fmt::format("every rank receives the root's {} elements", count));
  const std::vector<float*> data = output_pointers(c);
  const bool streaming = streams(bytes_of(count * n));
  return [=](int r, rt::TaskContext&) {
    if (r != root) detail::copy_floats(data[r], data[root], count, streaming);
  };
}

MemberWork plan_send_recv(const Collective& c) {
  const std::span<const float> data = c.members[0].input;
  const std::span<float> into = c.members[1].output;
  if (data.size() != into.size())
    throw std::invalid_argument(
        fmt::format("send_recv from device {} to device {}: sending {} elements into a buffer of "
                    "{}; both sides must have the same size",
                    c.group.device(0), c.group.device(1), data.size(), into.size()));
  const float* source = data.data();
  float* target = into.data();
  const std::size_t count = data.size();
  const bool streaming = streams(2 * bytes_of(count));
  return [=](int r, rt::TaskContext&) {
    if (r == 1) detail::copy_floats(target, source, count, streaming);
  };
}

MemberWork plan_barrier(const Collective&) {
  return {};  // the rendezvous is the whole of it
}

// Each op's plan, in CollectiveOp's order.
struct OpPlan {
  CollectiveOp op;
  MemberWork (*plan)(const Collective&);
};
constexpr std::array kPlans{
    OpPlan{CollectiveOp::all_reduce, plan_all_reduce},
    OpPlan{CollectiveOp::all_gather, plan_all_gather},
    OpPlan{CollectiveOp::reduce_scatter, plan_reduce_scatter},
    OpPlan{CollectiveOp::all_to_all, plan_all_to_all},
    OpPlan{CollectiveOp::all_to_all_v, plan_all_to_all_v},
    OpPlan{CollectiveOp::all_gather_v, plan_all_gather_v},
    OpPlan{CollectiveOp::reduce_scatter_v, plan_reduce_scatter_v},
    OpPlan{CollectiveOp::broadcast, plan_broadcast},
    OpPlan{CollectiveOp::send_recv, plan_send_recv},
    OpPlan{CollectiveOp::barrier, plan_barrier},
};
static_assert(detail::lists_every_op(kPlans), "a shared-memory plan for every collective op");

}  // namespace

MemberWork SharedMemoryCommunicator::plan(const Collective& c) {
  return kPlans[static_cast<std::size_t>(c.call.op)].plan(c);
}

}  // namespace weave::devices
