#include "weave/devices/shared_memory_communicator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "collective_kernels.hpp"

namespace weave::devices {

namespace {

using MemberTasks = Communicator::MemberTasks;

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

// The ring algorithm's per-member volume: (n-1)/n of `bytes`.
double ring_share(int n, std::size_t bytes) {
  return static_cast<double>(n - 1) / n * static_cast<double>(bytes);
}

std::vector<rt::CostHint> same_cost(int n, double bytes, int messages) {
  return std::vector<rt::CostHint>(
      static_cast<std::size_t>(n),
      {.bytes = n > 1 ? bytes : 0.0, .messages = static_cast<std::uint32_t>(n > 1 ? messages : 0)});
}

void check_count(const char* op, const ProcessGroup& g, std::size_t given, const char* what) {
  if (given != static_cast<std::size_t>(g.size()))
    throw std::invalid_argument(
        fmt::format("{} over group '{}' of {} ranks got {} {}: pass one per rank, in rank order",
                    op, g.name(), g.size(), given, what));
}

// Every rank's `what` must hold `expected` elements, for the reason `rule`.
template <typename Span>
void check_sizes(const char* op, const ProcessGroup& g, std::span<const Span> buffers,
                 std::size_t expected, const char* what, const std::string& rule) {
  for (int r = 0; r < g.size(); ++r)
    if (buffers[r].size() != expected)
      throw std::invalid_argument(
          fmt::format("{} over group '{}': rank {} (device {}) has an {} of {} elements where {} "
                      "are needed ({}); size every rank's buffers alike",
                      op, g.name(), r, g.device(r), what, buffers[r].size(), expected, rule));
}

template <typename Span>
auto pointers(std::span<const Span> buffers) {
  std::vector<typename Span::pointer> p;
  p.reserve(buffers.size());
  for (const auto& b : buffers)
    p.push_back(b.data());
  return p;
}

// Adds one task per rank joined in a rendezvous; `work(rank)` is that member's share of the
// transfer, run once every member has arrived. An empty `work` adds tasks that only meet.
// `work(r, context)` is member r's share.
MemberTasks add_members(rt::GraphBuilder& graph, const ProcessGroup& group, const char* op,
                        const CollectiveOptions& options, const std::vector<rt::CostHint>& costs,
                        std::function<void(int, rt::TaskContext&)> work) {
  const rt::StreamId stream = graph.stream(options.stream);
  const std::string prefix =
      options.name.empty() ? fmt::format("{}:{}", op, group.name()) : std::string(options.name);
  auto shared = std::make_shared<const std::function<void(int, rt::TaskContext&)>>(std::move(work));
  MemberTasks ids;
  ids.reserve(static_cast<std::size_t>(group.size()));
  for (int r = 0; r < group.size(); ++r) {
    rt::TaskFn fn;
    if (*shared) fn = [shared, r](rt::TaskContext& context) { (*shared)(r, context); };
    ids.push_back(graph.add({.device = group.device(r),
                             .stream = stream,
                             .kind = rt::TaskKind::comm,
                             .name = fmt::format("{}[{}]", prefix, r),
                             .tags = options.tags,
                             .cost = costs[static_cast<std::size_t>(r)]},
                            std::move(fn)));
  }
  graph.rendezvous(prefix, ids);
  return ids;
}

MemberTasks add_members(rt::GraphBuilder& graph, const ProcessGroup& group, const char* op,
                        const CollectiveOptions& options, const std::vector<rt::CostHint>& costs,
                        std::function<void(int)> work) {
  std::function<void(int, rt::TaskContext&)> with_context;
  if (work) with_context = [work = std::move(work)](int r, rt::TaskContext&) { work(r); };
  return add_members(graph, group, op, options, costs, std::move(with_context));
}

}  // namespace

MemberTasks SharedMemoryCommunicator::all_reduce(rt::GraphBuilder& graph, const ProcessGroup& group,
                                                 std::span<const std::span<float>> buffers,
                                                 ReduceOp op, const CollectiveOptions& options) {
  check_count("all_reduce", group, buffers.size(), "buffers");
  const std::size_t count = buffers[0].size();
  check_sizes("all_reduce", group, buffers, count, "input/output buffer",
              fmt::format("every rank reduces a buffer of rank 0's size, {} elements", count));
  const int n = group.size();
  const std::vector<float*> data = pointers(buffers);
  const std::vector<const float*> sources(data.begin(), data.end());
  // Member r reduces its share of every rank's buffer and writes the result to every rank's
  // buffer. In place and still race-free: only member r touches its share, and the kernel
  // reads each element from every rank before writing it. Regular stores beat streaming ones
  // here: the lines written were just read, so they are already cached.
  std::function<void(int)> work;
  if (n > 1)
    work = [=](int r) {
      const auto [first, last] = share(count, n, r);
      detail::reduce_to_all(op, sources, first, data, first, last - first, false);
    };
  return add_members(graph, group, "all_reduce", options,
                     same_cost(n, 2 * ring_share(n, bytes_of(count)), 2 * (n - 1)),
                     std::move(work));
}

MemberTasks SharedMemoryCommunicator::all_gather(rt::GraphBuilder& graph, const ProcessGroup& group,
                                                 std::span<const std::span<const float>> inputs,
                                                 std::span<const std::span<float>> outputs,
                                                 const CollectiveOptions& options) {
  check_count("all_gather", group, inputs.size(), "inputs");
  check_count("all_gather", group, outputs.size(), "outputs");
  const int n = group.size();
  const std::size_t m = inputs[0].size();
  check_sizes("all_gather", group, inputs, m, "input",
              fmt::format("every rank contributes rank 0's {} elements", m));
  check_sizes("all_gather", group, outputs, m * n, "output",
              fmt::format("each output holds group size x input = {} x {}", n, m));
  const std::vector<const float*> in = pointers(inputs);
  const std::vector<float*> out = pointers(outputs);
  const bool streaming = streams(bytes_of(m * n * (n + 1)));
  // Member r pushes its shard into every output: it reads the shard once, whatever n is.
  return add_members(graph, group, "all_gather", options,
                     same_cost(n, ring_share(n, bytes_of(m * n)), n - 1), [=](int r) {
                       const std::span<const float* const> shard(&in[r], 1);
                       detail::reduce_to_all(ReduceOp::sum, shard, 0, out,
                                             static_cast<std::size_t>(r) * m, m, streaming);
                     });
}

MemberTasks SharedMemoryCommunicator::reduce_scatter(rt::GraphBuilder& graph,
                                                     const ProcessGroup& group,
                                                     std::span<const std::span<const float>> inputs,
                                                     std::span<const std::span<float>> outputs,
                                                     ReduceOp op,
                                                     const CollectiveOptions& options) {
  check_count("reduce_scatter", group, inputs.size(), "inputs");
  check_count("reduce_scatter", group, outputs.size(), "outputs");
  const int n = group.size();
  const std::size_t m = outputs[0].size();
  check_sizes("reduce_scatter", group, outputs, m, "output",
              fmt::format("every rank receives rank 0's {} elements", m));
  check_sizes("reduce_scatter", group, inputs, m * n, "input",
              fmt::format("each input holds group size x output = {} x {}", n, m));
  const std::vector<const float*> in = pointers(inputs);
  const std::vector<float*> out = pointers(outputs);
  const bool streaming = streams(bytes_of(m * n * (n + 1)));
  // Member r reduces block r of every input into its own output.
  return add_members(graph, group, "reduce_scatter", options,
                     same_cost(n, ring_share(n, bytes_of(m * n)), n - 1), [=](int r) {
                       const std::span<float* const> mine(&out[r], 1);
                       detail::reduce_to_all(op, in, static_cast<std::size_t>(r) * m, mine, 0, m,
                                             streaming);
                     });
}

MemberTasks SharedMemoryCommunicator::all_to_all(rt::GraphBuilder& graph, const ProcessGroup& group,
                                                 std::span<const std::span<const float>> inputs,
                                                 std::span<const std::span<float>> outputs,
                                                 const CollectiveOptions& options) {
  check_count("all_to_all", group, inputs.size(), "inputs");
  check_count("all_to_all", group, outputs.size(), "outputs");
  const int n = group.size();
  const std::size_t total = inputs[0].size();
  if (total % static_cast<std::size_t>(n) != 0)
    throw std::invalid_argument(
        fmt::format("all_to_all over group '{}': rank 0's {} elements cannot be split into {} "
                    "equal blocks, one per rank; pad them to a multiple of {} or use all_to_all_v",
                    group.name(), total, n, n));
  const std::string rule = fmt::format("every rank sends and receives {} blocks of {} elements", n,
                                       total / static_cast<std::size_t>(n));
  check_sizes("all_to_all", group, inputs, total, "input", rule);
  check_sizes("all_to_all", group, outputs, total, "output", rule);
  const std::size_t m = total / static_cast<std::size_t>(n);
  const std::vector<const float*> in = pointers(inputs);
  const std::vector<float*> out = pointers(outputs);
  const bool streaming = streams(2 * bytes_of(total * n));
  // Member r pulls its block from every input.
  return add_members(graph, group, "all_to_all", options,
                     same_cost(n, ring_share(n, bytes_of(total)), n - 1), [=](int r) {
                       for (int j = 0; j < n; ++j)
                         detail::copy_floats(out[r] + static_cast<std::size_t>(j) * m,
                                             in[j] + static_cast<std::size_t>(r) * m, m, streaming);
                     });
}

MemberTasks SharedMemoryCommunicator::all_to_all_v(rt::GraphBuilder& graph,
                                                   const ProcessGroup& group,
                                                   std::span<const VariableAllToAllBuffers> buffers,
                                                   std::int64_t row_elements,
                                                   const CollectiveOptions& options) {
  check_count("all_to_all_v", group, buffers.size(), "buffers");
  const int n = group.size();
  if (row_elements < 1)
    throw std::invalid_argument(fmt::format(
        "all_to_all_v over group '{}': a row must hold at least 1 element, got {}; pass the "
        "number of floats per token row",
        group.name(), row_elements));
  for (int r = 0; r < n; ++r) {
    if (!buffers[r].send_counts)
      throw std::invalid_argument(
          fmt::format("all_to_all_v over group '{}': rank {} (device {}) has no send_counts; "
                      "point it at the vector an earlier task fills",
                      group.name(), r, group.device(r)));
    if (buffers[r].recv_counts.size() != static_cast<std::size_t>(n))
      throw std::invalid_argument(
          fmt::format("all_to_all_v over group '{}': rank {} (device {}) has room for {} receive "
                      "counts; give it one per rank, {}",
                      group.name(), r, group.device(r), buffers[r].recv_counts.size(), n));
  }
  const std::vector<VariableAllToAllBuffers> b(buffers.begin(), buffers.end());
  const auto row = static_cast<std::size_t>(row_elements);
  const std::string group_name = group.name();
  // The split is unknown until run time: the hint costs each member's expected rows (or its
  // whole send buffer) spread evenly over the ranks; the member reports the real split.
  std::vector<rt::CostHint> costs;
  for (int r = 0; r < n; ++r) {
    const std::size_t elements = b[r].expected_rows > 0
                                     ? static_cast<std::size_t>(b[r].expected_rows) * row
                                     : b[r].send.size();
    costs.push_back({.bytes = n > 1 ? ring_share(n, bytes_of(elements)) : 0.0,
                     .messages = static_cast<std::uint32_t>(n - 1)});
  }
  return add_members(
      graph, group, "all_to_all_v", options, costs, [=](int r, rt::TaskContext& context) {
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
          for (std::int64_t c : counts) {
            if (c < 0)
              throw std::runtime_error(
                  fmt::format("all_to_all_v over group '{}': rank {} sends a negative count {}",
                              group_name, j, c));
            rows += static_cast<std::size_t>(c);
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
              "holds {}; size it for the largest possible split (dropless MoE: tokens x top-k "
              "rows)",
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
      });
}

MemberTasks SharedMemoryCommunicator::broadcast(rt::GraphBuilder& graph, const ProcessGroup& group,
                                                std::span<const std::span<float>> buffers, int root,
                                                const CollectiveOptions& options) {
  check_count("broadcast", group, buffers.size(), "buffers");
  const int n = group.size();
  if (root < 0 || root >= n)
    throw std::invalid_argument(
        fmt::format("broadcast over group '{}': root rank {} is outside [0, {}); name the root "
                    "by its rank in the group, not its device",
                    group.name(), root, n));
  const std::size_t count = buffers[root].size();
  check_sizes("broadcast", group, buffers, count, "input/output buffer",
              fmt::format("every rank receives the root's {} elements", count));
  const std::vector<float*> data = pointers(buffers);
  const bool streaming = streams(bytes_of(count * n));
  // A pipelined chain from the root: every member but the last forwards the whole buffer.
  std::vector<rt::CostHint> costs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r)
    if ((r - root + n) % n < n - 1)
      costs[r] = {.bytes = static_cast<double>(bytes_of(count)),
                  .messages = static_cast<std::uint32_t>(n - 1)};
  return add_members(graph, group, "broadcast", options, costs, [=](int r) {
    if (r != root) detail::copy_floats(data[r], data[root], count, streaming);
  });
}

std::pair<rt::TaskId, rt::TaskId> SharedMemoryCommunicator::send_recv(
    rt::GraphBuilder& graph, rt::DeviceId from, std::span<const float> data, rt::DeviceId to,
    std::span<float> into, const CollectiveOptions& options) {
  if (from == to)
    throw std::invalid_argument(fmt::format(
        "send_recv from device {} to itself: a transfer needs two devices; copy within the "
        "device instead",
        from));
  if (data.size() != into.size())
    throw std::invalid_argument(
        fmt::format("send_recv from device {} to device {}: sending {} elements into a buffer of "
                    "{}; both sides must have the same size",
                    from, to, data.size(), into.size()));
  const ProcessGroup pair(fmt::format("{}->{}", from, to), {from, to});
  const float* source = data.data();
  float* target = into.data();
  const std::size_t count = data.size();
  const bool streaming = streams(2 * bytes_of(count));
  const std::vector<rt::CostHint> costs{
      {.bytes = static_cast<double>(bytes_of(count)), .messages = 1}, {}};
  const MemberTasks ids = add_members(graph, pair, "send_recv", options, costs, [=](int r) {
    if (r == 1) detail::copy_floats(target, source, count, streaming);
  });
  return {ids[0], ids[1]};
}

MemberTasks SharedMemoryCommunicator::barrier(rt::GraphBuilder& graph, const ProcessGroup& group,
                                              const CollectiveOptions& options) {
  // A dissemination barrier: ceil(log2 n) rounds of messages.
  const int rounds = std::bit_width(static_cast<unsigned>(group.size() - 1));
  return add_members(graph, group, "barrier", options, same_cost(group.size(), 0.0, rounds),
                     std::function<void(int)>{});
}

}  // namespace weave::devices
