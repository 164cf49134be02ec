#include "weave/devices/shared_memory_communicator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <stdexcept>

namespace weave::devices {

namespace {

using MemberTasks = Communicator::MemberTasks;

// Elements reduced at a time: the block and its partial result stay in L1 while every rank's
// contribution is added, so each element is read once from each rank and written once to each.
constexpr std::size_t kReduceBlock = 4096;

std::size_t bytes_of(std::size_t elements) {
  return elements * sizeof(float);
}

// [first, last) of `count` elements that rank r of n handles: even shares, the remainder
// spread over the first ranks.
std::pair<std::size_t, std::size_t> share(std::size_t count, int n, int r) {
  const std::size_t base = count / static_cast<std::size_t>(n),
                    extra = count % static_cast<std::size_t>(n);
  const auto ur = static_cast<std::size_t>(r);
  const std::size_t first = ur * base + std::min(ur, extra);
  return {first, first + base + (ur < extra ? 1 : 0)};
}

void combine(ReduceOp op, float* acc, const float* x, std::size_t n) {
  if (op == ReduceOp::sum) {
    for (std::size_t i = 0; i < n; ++i)
      acc[i] += x[i];
  } else {
    for (std::size_t i = 0; i < n; ++i)
      acc[i] = std::max(acc[i], x[i]);
  }
}

// Reduces elements [first, last) of every source, in rank order, into every destination.
void reduce_range(ReduceOp op, const std::vector<const float*>& sources,
                  const std::vector<float*>& destinations, std::size_t first, std::size_t last,
                  std::size_t destination_offset) {
  alignas(64) float block[kReduceBlock];
  for (std::size_t at = first; at < last; at += kReduceBlock) {
    const std::size_t n = std::min(kReduceBlock, last - at);
    std::memcpy(block, sources[0] + at, bytes_of(n));
    for (std::size_t s = 1; s < sources.size(); ++s)
      combine(op, block, sources[s] + at, n);
    for (float* d : destinations)
      std::memcpy(d + (at - first) + destination_offset, block, bytes_of(n));
  }
}

void copy(float* to, const float* from, std::size_t n) {
  if (n > 0 && to != from) std::memcpy(to, from, bytes_of(n));
}

void check_count(const char* op, const ProcessGroup& g, std::size_t given, const char* what) {
  if (given != static_cast<std::size_t>(g.size()))
    throw std::invalid_argument(
        fmt::format("{} over group '{}' of {} ranks got {} {}: pass one per rank, in rank order",
                    op, g.name(), g.size(), given, what));
}

template <typename Span>
void check_equal_sizes(const char* op, const ProcessGroup& g, std::span<const Span> buffers,
                       std::size_t expected, const char* what) {
  for (int r = 0; r < g.size(); ++r)
    if (buffers[r].size() != expected)
      throw std::invalid_argument(fmt::format(
          "{} over group '{}': rank {} (device {}) has an {} of {} elements where {} are needed; "
          "every rank's sizes must agree",
          op, g.name(), r, g.device(r), what, buffers[r].size(), expected));
}

// Adds the member tasks: `work(rank)` is that member's share, run once all have arrived.
MemberTasks add_members(rt::GraphBuilder& graph, const ProcessGroup& group, const char* op,
                        const CollectiveOptions& options, double bytes_per_member,
                        std::function<void(int)> work) {
  const rt::StreamId stream = graph.stream(options.stream);
  const std::string prefix =
      options.name.empty() ? fmt::format("{}:{}", op, group.name()) : std::string(options.name);
  auto shared = std::make_shared<std::function<void(int)>>(std::move(work));
  MemberTasks ids;
  ids.reserve(static_cast<std::size_t>(group.size()));
  for (int r = 0; r < group.size(); ++r) {
    rt::TaskFn fn;
    if (*shared) fn = [shared, r](rt::TaskContext&) { (*shared)(r); };
    ids.push_back(graph.add({.device = group.device(r),
                             .stream = stream,
                             .kind = rt::TaskKind::comm,
                             .name = fmt::format("{}[{}]", prefix, r),
                             .tags = options.tags,
                             .cost = {.bytes = bytes_per_member, .messages = 1}},
                            std::move(fn)));
  }
  graph.rendezvous(prefix, ids);
  return ids;
}

// The buffers' addresses by rank, captured by the member tasks.
template <typename T>
std::vector<T*> data_of(std::span<const std::span<T>> buffers) {
  std::vector<T*> pointers;
  for (const auto& b : buffers)
    pointers.push_back(b.data());
  return pointers;
}

double ring_fraction(int n) {
  return n > 1 ? static_cast<double>(n - 1) / n : 0.0;
}

}  // namespace

MemberTasks SharedMemoryCommunicator::all_reduce(rt::GraphBuilder& graph, const ProcessGroup& group,
                                                 std::span<const std::span<float>> buffers,
                                                 ReduceOp op, const CollectiveOptions& options) {
  check_count("all_reduce", group, buffers.size(), "buffers");
  const std::size_t count = buffers[0].size();
  check_equal_sizes<std::span<float>>("all_reduce", group, buffers, count, "input/output buffer");
  const int n = group.size();
  const auto data = data_of(buffers);
  const std::vector<const float*> sources(data.begin(), data.end());
  return add_members(graph, group, "all_reduce", options,
                     2.0 * ring_fraction(n) * static_cast<double>(bytes_of(count)), [=](int r) {
                       const auto [first, last] = share(count, n, r);
                       reduce_range(op, sources, data, first, last, first);
                     });
}

MemberTasks SharedMemoryCommunicator::all_gather(rt::GraphBuilder& graph, const ProcessGroup& group,
                                                 std::span<const std::span<const float>> inputs,
                                                 std::span<const std::span<float>> outputs,
                                                 const CollectiveOptions& options) {
  check_count("all_gather", group, inputs.size(), "inputs");
  check_count("all_gather", group, outputs.size(), "outputs");
  const int n = group.size();
  const std::size_t m = inputs[0].size();
  check_equal_sizes<std::span<const float>>("all_gather", group, inputs, m, "input");
  check_equal_sizes<std::span<float>>("all_gather", group, outputs, m * n, "output");
  const auto in = data_of(inputs);
  const auto out = data_of(outputs);
  // Each member pushes its shard to every output.
  return add_members(graph, group, "all_gather", options,
                     ring_fraction(n) * static_cast<double>(bytes_of(m * n)), [=](int r) {
                       for (int j = 0; j < n; ++j)
                         copy(out[j] + static_cast<std::size_t>(r) * m, in[r], m);
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
  check_equal_sizes<std::span<float>>("reduce_scatter", group, outputs, m, "output");
  check_equal_sizes<std::span<const float>>("reduce_scatter", group, inputs, m * n, "input");
  const auto in = data_of(inputs);
  const auto out = data_of(outputs);
  return add_members(graph, group, "reduce_scatter", options,
                     ring_fraction(n) * static_cast<double>(bytes_of(m * n)), [=](int r) {
                       const std::size_t first = static_cast<std::size_t>(r) * m;
                       reduce_range(op, in, {out[r]}, first, first + m, 0);
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
    throw std::invalid_argument(fmt::format(
        "all_to_all over group '{}': {} elements cannot be split into {} equal blocks; use "
        "all_to_all_v for uneven splits",
        group.name(), total, n));
  check_equal_sizes<std::span<const float>>("all_to_all", group, inputs, total, "input");
  check_equal_sizes<std::span<float>>("all_to_all", group, outputs, total, "output");
  const std::size_t m = total / static_cast<std::size_t>(n);
  const auto in = data_of(inputs);
  const auto out = data_of(outputs);
  // Each member pulls its blocks from every input.
  return add_members(graph, group, "all_to_all", options,
                     ring_fraction(n) * static_cast<double>(bytes_of(total)), [=](int r) {
                       for (int j = 0; j < n; ++j)
                         copy(out[r] + static_cast<std::size_t>(j) * m,
                              in[j] + static_cast<std::size_t>(r) * m, m);
                     });
}

MemberTasks SharedMemoryCommunicator::all_to_all_v(rt::GraphBuilder& graph,
                                                   const ProcessGroup& group,
                                                   std::span<const VariableAllToAllBuffers> buffers,
                                                   std::int64_t row_elements,
                                                   const CollectiveOptions& options) {
  check_count("all_to_all_v", group, buffers.size(), "buffers");
  if (row_elements < 1)
    throw std::invalid_argument(
        fmt::format("all_to_all_v: rows must hold >= 1 element, got {}", row_elements));
  const int n = group.size();
  for (int r = 0; r < n; ++r)
    if (!buffers[r].send_counts || !buffers[r].recv_counts)
      throw std::invalid_argument(fmt::format(
          "all_to_all_v over group '{}': rank {} needs both send_counts and recv_counts",
          group.name(), r));
  std::vector<VariableAllToAllBuffers> b(buffers.begin(), buffers.end());
  const auto row = static_cast<std::size_t>(row_elements);
  const std::string group_name = group.name();
  double capacity = 0;
  for (const auto& x : b)
    capacity = std::max(capacity, static_cast<double>(bytes_of(x.send.size())));
  return add_members(
      graph, group, "all_to_all_v", options, ring_fraction(n) * capacity, [=](int r) {
        // Every member's counts are final here: the rendezvous started no member's transfer
        // before all had arrived, so the tasks that filled them have completed.
        for (int j = 0; j < n; ++j) {
          const auto& counts = *b[j].send_counts;
          if (counts.size() != static_cast<std::size_t>(n))
            throw std::runtime_error(fmt::format(
                "all_to_all_v over group '{}': rank {} has {} send counts, needs one per rank "
                "({})",
                group_name, j, counts.size(), n));
          std::int64_t rows = 0;
          for (std::int64_t c : counts) {
            if (c < 0)
              throw std::runtime_error(
                  fmt::format("all_to_all_v over group '{}': rank {} sends a negative count {}",
                              group_name, j, c));
            rows += c;
          }
          if (static_cast<std::size_t>(rows) * row > b[j].send.size())
            throw std::runtime_error(fmt::format(
                "all_to_all_v over group '{}': rank {} sends {} rows of {} elements but its send "
                "buffer holds {} elements",
                group_name, j, rows, row, b[j].send.size()));
        }
        std::vector<std::int64_t>& received = *b[r].recv_counts;
        received.assign(static_cast<std::size_t>(n), 0);
        std::size_t total = 0;
        for (int j = 0; j < n; ++j) {
          received[j] = (*b[j].send_counts)[r];
          total += static_cast<std::size_t>(received[j]) * row;
        }
        if (total > b[r].recv.size())
          throw std::runtime_error(fmt::format(
              "all_to_all_v over group '{}': rank {} receives {} elements but its receive buffer "
              "holds {}; size it for the largest possible split (dropless MoE: tokens x top-k "
              "rows)",
              group_name, r, total, b[r].recv.size()));
        std::size_t at = 0;
        for (int j = 0; j < n; ++j) {
          const auto& counts = *b[j].send_counts;
          std::size_t from = 0;
          for (int k = 0; k < r; ++k)
            from += static_cast<std::size_t>(counts[k]) * row;
          const std::size_t len = static_cast<std::size_t>(counts[r]) * row;
          copy(b[r].recv.data() + at, b[j].send.data() + from, len);
          at += len;
        }
      });
}

MemberTasks SharedMemoryCommunicator::broadcast(rt::GraphBuilder& graph, const ProcessGroup& group,
                                                std::span<const std::span<float>> buffers, int root,
                                                const CollectiveOptions& options) {
  check_count("broadcast", group, buffers.size(), "buffers");
  if (root < 0 || root >= group.size())
    throw std::invalid_argument(
        fmt::format("broadcast over group '{}': root rank {} is outside [0, {})", group.name(),
                    root, group.size()));
  const std::size_t count = buffers[root].size();
  check_equal_sizes<std::span<float>>("broadcast", group, buffers, count, "input/output buffer");
  const auto data = data_of(buffers);
  return add_members(graph, group, "broadcast", options, static_cast<double>(bytes_of(count)),
                     [=](int r) {
                       if (r != root) copy(data[r], data[root], count);
                     });
}

std::pair<rt::TaskId, rt::TaskId> SharedMemoryCommunicator::send_recv(
    rt::GraphBuilder& graph, rt::DeviceId from, std::span<const float> data, rt::DeviceId to,
    std::span<float> into, const CollectiveOptions& options) {
  if (from == to)
    throw std::invalid_argument(
        fmt::format("send_recv from device {} to itself: copy within the device instead", from));
  if (data.size() != into.size())
    throw std::invalid_argument(fmt::format(
        "send_recv from device {} to device {}: sending {} elements into a buffer of {}", from, to,
        data.size(), into.size()));
  const ProcessGroup pair(fmt::format("{}->{}", from, to), {from, to});
  const float* source = data.data();
  float* target = into.data();
  const std::size_t count = data.size();
  const MemberTasks ids = add_members(graph, pair, "send_recv", options,
                                      static_cast<double>(bytes_of(count)), [=](int r) {
                                        if (r == 1) copy(target, source, count);
                                      });
  return {ids[0], ids[1]};
}

MemberTasks SharedMemoryCommunicator::barrier(rt::GraphBuilder& graph, const ProcessGroup& group,
                                              const CollectiveOptions& options) {
  return add_members(graph, group, "barrier", options, 0.0, {});
}

}  // namespace weave::devices
