// Shared-memory collectives against serial references: every operation for group sizes 1 to 8
// on one and on two worker threads, empty, single-element, odd and multi-KiB sizes, uneven
// all-to-all splits, sizes large enough for streaming stores, bitwise reproducibility across
// runs and thread counts, cost hints, and clear errors for bad input at build and run time.
#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "weave/devices/collective_matcher.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/packed_halves.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::devices {
namespace {

using Buffers = std::vector<std::vector<float>>;

// Single-slot device arenas under a thread limit, and an executor over them.
class Machine {
 public:
  explicit Machine(int threads, int devices = 8)
      : limit_(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(threads)) {
    for (int d = 0; d < devices; ++d)
      arenas_.push_back(std::make_unique<tbb::task_arena>(1, 0));
    std::vector<tbb::task_arena*> raw;
    for (auto& a : arenas_)
      raw.push_back(a.get());
    executor_ = std::make_unique<rt::Executor>(raw);
  }
  void run(rt::GraphBuilder& b) { executor_->run(b.build()); }
  rt::RunResult run(const rt::Graph& g, const rt::RunOptions& o = {}) {
    return executor_->run(g, o);
  }

 private:
  tbb::global_control limit_;
  std::vector<std::unique_ptr<tbb::task_arena>> arenas_;
  std::unique_ptr<rt::Executor> executor_;
};

// Values spread over many binades, so that the order of a sum changes its rounding.
std::vector<float> random_values(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> mantissa(-1.f, 1.f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::vector<float> v(n);
  for (auto& x : v)
    x = std::ldexp(mantissa(gen), exponent(gen));
  return v;
}

Buffers random_buffers(int ranks, std::size_t size, unsigned seed) {
  Buffers b;
  for (int r = 0; r < ranks; ++r)
    b.push_back(random_values(size, seed + 1000 * static_cast<unsigned>(r)));
  return b;
}

ProcessGroup first_devices(int n) {
  std::vector<rt::DeviceId> devices(static_cast<std::size_t>(n));
  std::iota(devices.begin(), devices.end(), 0u);
  return ProcessGroup("g", devices);
}

template <typename T>
std::vector<std::span<T>> spans(Buffers& v) {
  std::vector<std::span<T>> s;
  for (auto& x : v)
    s.emplace_back(x);
  return s;
}

float reduce(ReduceOp op, float a, float b) {
  return op == ReduceOp::sum ? a + b : std::max(a, b);
}

// Element i reduced over the buffers in rank order 0, 1, ..., n-1, from offset `at` of each.
std::vector<float> reference_reduction(ReduceOp op, const Buffers& in, std::size_t at,
                                       std::size_t count) {
  std::vector<float> out(in[0].begin() + static_cast<std::ptrdiff_t>(at),
                         in[0].begin() + static_cast<std::ptrdiff_t>(at + count));
  for (std::size_t r = 1; r < in.size(); ++r)
    for (std::size_t i = 0; i < count; ++i)
      out[i] = reduce(op, out[i], in[r][at + i]);
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  // An empty vector's data() may be null, which memcmp must not be given even for 0 bytes.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// (group size, threads)
class Collective : public ::testing::TestWithParam<std::tuple<int, int>> {
 protected:
  int n() const { return std::get<0>(GetParam()); }
  int threads() const { return std::get<1>(GetParam()); }
  SharedMemoryCommunicator comm;
};

// Empty, one element, odd, a few KiB, more than one 64-float strip per rank with a ragged tail.
const std::size_t kSizes[] = {0, 1, 7, 65, 1000, 4099, 40'003};

TEST_P(Collective, AllReduceSumAndMaxMatchRankOrderReduction) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    for (std::size_t size : kSizes) {
      Buffers bufs = random_buffers(n(), size, static_cast<unsigned>(size));
      const std::vector<float> expect = reference_reduction(op, bufs, 0, size);
      rt::GraphBuilder b;
      comm.all_reduce(b, g, spans<float>(bufs), op);
      machine.run(b);
      for (int r = 0; r < n(); ++r)
        ASSERT_TRUE(same_bits(bufs[r], expect)) << "rank " << r << ", size " << size;
    }
  }
}

TEST_P(Collective, AllGatherConcatenatesInRankOrder) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  for (std::size_t m : {0, 1, 13, 1500}) {
    Buffers in = random_buffers(n(), m, 7), out(n(), std::vector<float>(m * n(), -1.f));
    std::vector<float> expect;
    for (const auto& x : in)
      expect.insert(expect.end(), x.begin(), x.end());
    rt::GraphBuilder b;
    comm.all_gather(b, g, spans<const float>(in), spans<float>(out));
    machine.run(b);
    for (int r = 0; r < n(); ++r)
      ASSERT_EQ(out[r], expect) << "rank " << r << ", shard " << m;
  }
}

TEST_P(Collective, ReduceScatterGivesEachRankItsReducedBlock) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    for (std::size_t m : {0, 1, 13, 1500}) {
      Buffers in = random_buffers(n(), m * n(), 3), out(n(), std::vector<float>(m, -1.f));
      rt::GraphBuilder b;
      comm.reduce_scatter(b, g, spans<const float>(in), spans<float>(out), op);
      machine.run(b);
      for (int r = 0; r < n(); ++r)
        ASSERT_TRUE(same_bits(out[r], reference_reduction(op, in, r * m, m)))
            << "rank " << r << ", block " << m;
    }
  }
}

TEST_P(Collective, AllToAllTransposesBlocks) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  for (std::size_t m : {0, 1, 3, 700}) {
    Buffers in = random_buffers(n(), m * n(), 5), out(n(), std::vector<float>(m * n(), -1.f));
    rt::GraphBuilder b;
    comm.all_to_all(b, g, spans<const float>(in), spans<float>(out));
    machine.run(b);
    for (int r = 0; r < n(); ++r)
      for (int j = 0; j < n(); ++j)
        for (std::size_t i = 0; i < m; ++i)
          ASSERT_EQ(out[r][j * m + i], in[j][r * m + i]) << r << " <- " << j << " at " << i;
  }
}

TEST_P(Collective, VariableAllToAllWithUnevenAndZeroSplits) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  const std::int64_t row = 3;
  const auto rows = [](int from, int to) { return (from + 2 * to) % 3 == 0 ? 0 : from + to + 1; };
  // The counts are filled by a task that runs before the collective, as a router would.
  std::vector<std::vector<std::int64_t>> send_counts(n()), recv_counts(n());
  Buffers send = random_buffers(n(), static_cast<std::size_t>(20 * n() * row), 11),
          recv(n(), std::vector<float>(static_cast<std::size_t>(20 * n() * row), -1.f));
  rt::GraphBuilder b;
  std::vector<VariableAllToAllBuffers> bufs;
  for (int r = 0; r < n(); ++r) {
    recv_counts[r].assign(n(), -7);
    bufs.push_back({send[r], &send_counts[r], recv[r], recv_counts[r]});
  }
  const auto members = comm.all_to_all_v(b, g, bufs, row);
  for (int r = 0; r < n(); ++r) {
    const rt::TaskId route =
        b.add({.device = static_cast<rt::DeviceId>(r), .name = "route"}, [&, r](rt::TaskContext&) {
          send_counts[r].clear();
          for (int j = 0; j < n(); ++j)
            send_counts[r].push_back(rows(r, j));
        });
    b.precede(route, members[r]);
  }
  machine.run(b);
  for (int r = 0; r < n(); ++r) {
    std::vector<float> expect;
    for (int j = 0; j < n(); ++j) {
      EXPECT_EQ(recv_counts[r][j], rows(j, r)) << r << " <- " << j;
      std::int64_t from = 0;
      for (int k = 0; k < r; ++k)
        from += rows(j, k) * row;
      expect.insert(expect.end(), send[j].begin() + from,
                    send[j].begin() + from + rows(j, r) * row);
    }
    ASSERT_TRUE(std::equal(expect.begin(), expect.end(), recv[r].begin())) << "rank " << r;
    // Nothing is written past what was received.
    EXPECT_TRUE(std::all_of(recv[r].begin() + static_cast<std::ptrdiff_t>(expect.size()),
                            recv[r].end(), [](float x) { return x == -1.f; }));
  }
}

// Blocks of run-time sizes (zero among them): every rank gathers every rank's rows in rank
// order; then each rank's block of the gathered buffers is reduced, in rank order, back to it.
TEST_P(Collective, VariableAllGatherAndReduceScatterWithUnevenAndZeroBlocks) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  const std::int64_t row = 3;
  const auto rows_of = [](int r) -> std::int64_t { return r % 3 == 1 ? 0 : 2 * r + 1; };
  std::int64_t total = 0;
  for (int r = 0; r < n(); ++r)
    total += rows_of(r);
  const auto capacity = static_cast<std::size_t>((2 * n() + 1) * row);
  Buffers send = random_buffers(n(), capacity, 21);
  Buffers gathered(n(), std::vector<float>(static_cast<std::size_t>(n()) * capacity, -1.f));
  Buffers reduced(n(), std::vector<float>(capacity, -1.f));
  std::vector<std::int64_t> send_rows(n(), -1);
  std::vector<std::vector<std::int64_t>> gathered_rows(n(), std::vector<std::int64_t>(n(), -7));
  rt::GraphBuilder b;
  std::vector<VariableGatherBuffers> gather;
  std::vector<VariableScatterBuffers> scatter;
  for (int r = 0; r < n(); ++r) {
    gather.push_back({send[r], &send_rows[r], gathered[r], gathered_rows[r]});
    scatter.push_back({gathered[r], &gathered_rows[r], reduced[r]});
  }
  const auto gathers = comm.all_gather_v(b, g, gather, row);
  const auto scatters = comm.reduce_scatter_v(b, g, scatter, row);
  for (int r = 0; r < n(); ++r) {
    const rt::TaskId count = b.add({.device = static_cast<rt::DeviceId>(r), .name = "count"},
                                   [&, r](rt::TaskContext&) { send_rows[r] = rows_of(r); });
    b.precede(count, gathers[r]);
    b.precede(gathers[r], scatters[r]);
  }
  machine.run(b);
  std::vector<float> expect_gathered;
  for (int j = 0; j < n(); ++j)
    expect_gathered.insert(expect_gathered.end(), send[j].begin(),
                           send[j].begin() + rows_of(j) * row);
  for (int r = 0; r < n(); ++r) {
    for (int j = 0; j < n(); ++j)
      EXPECT_EQ(gathered_rows[r][j], rows_of(j)) << r << " <- " << j;
    ASSERT_TRUE(std::equal(expect_gathered.begin(), expect_gathered.end(), gathered[r].begin()))
        << "rank " << r;
    EXPECT_TRUE(std::all_of(gathered[r].begin() + total * row, gathered[r].end(),
                            [](float x) { return x == -1.f; }));
    // Every rank gathered the same rows: the reduction of rank r's block is n times it, summed
    // in rank order.
    std::int64_t first = 0;
    for (int j = 0; j < r; ++j)
      first += rows_of(j) * row;
    std::vector<float> block(expect_gathered.begin() + first,
                             expect_gathered.begin() + first + rows_of(r) * row);
    std::vector<float> expect(block.size(), 0.f);
    for (int j = 0; j < n(); ++j)
      for (std::size_t i = 0; i < block.size(); ++i)
        expect[i] = j == 0 ? block[i] : expect[i] + block[i];
    ASSERT_TRUE(same_bits(
        std::vector<float>(reduced[r].begin(),
                           reduced[r].begin() + static_cast<std::ptrdiff_t>(block.size())),
        expect))
        << "rank " << r;
  }
}

TEST_P(Collective, BroadcastCopiesTheRootsBuffer) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  for (int root : {0, n() - 1}) {
    for (std::size_t size : {0, 1, 77, 3000}) {
      Buffers bufs = random_buffers(n(), size, 40);
      const std::vector<float> expect = bufs[root];
      rt::GraphBuilder b;
      comm.broadcast(b, g, spans<float>(bufs), root);
      machine.run(b);
      for (int r = 0; r < n(); ++r)
        ASSERT_EQ(bufs[r], expect) << "root " << root << ", rank " << r << ", size " << size;
    }
  }
}

TEST_P(Collective, BarrierHoldsEveryMemberUntilAllArrive) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  // Each member's predecessor counts itself in; each member's successor sees every count.
  std::atomic<int> arrived{0};
  std::vector<int> seen(n(), -1);
  rt::GraphBuilder b;
  const auto members = comm.barrier(b, g);
  for (int r = 0; r < n(); ++r) {
    const auto d = static_cast<rt::DeviceId>(r);
    const rt::TaskId before = b.add({.device = d}, [&](rt::TaskContext&) { ++arrived; });
    const rt::TaskId after =
        b.add({.device = d}, [&, r](rt::TaskContext&) { seen[r] = arrived.load(); });
    b.precede(before, members[r]);
    b.precede(members[r], after);
  }
  machine.run(b);
  EXPECT_EQ(seen, std::vector<int>(n(), n()));
}

TEST_P(Collective, ResultsAreBitwiseIdenticalAcrossRuns) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  const Buffers original = random_buffers(n(), 9001, 90);
  Buffers bufs = original;
  rt::GraphBuilder b;
  // Restore the inputs on the comm stream (which orders them before the collective), then
  // reduce: the same graph run three times.
  for (int r = 0; r < n(); ++r)
    b.add({.device = static_cast<rt::DeviceId>(r), .stream = b.stream("comm")},
          [&, r](rt::TaskContext&) { bufs[r] = original[r]; });
  comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  const rt::Graph graph = b.build();
  const std::vector<float> expect = reference_reduction(ReduceOp::sum, original, 0, 9001);
  for (int run = 0; run < 3; ++run) {
    machine.run(graph);
    for (int r = 0; r < n(); ++r)
      ASSERT_TRUE(same_bits(bufs[r], expect)) << "run " << run << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(GroupsAndThreads, Collective,
                         ::testing::Combine(::testing::Range(1, 9), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_threads" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Collectives, AllReduceIsBitwiseIdenticalAcrossThreadCounts) {
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(8);
  const Buffers original = random_buffers(8, 40'003, 21);
  // The data is order-sensitive: summed in reverse rank order some elements round differently,
  // so matching the rank-order reference bit for bit means the order was kept.
  Buffers reversed(original.rbegin(), original.rend());
  const std::vector<float> forward = reference_reduction(ReduceOp::sum, original, 0, 40'003);
  ASSERT_FALSE(same_bits(forward, reference_reduction(ReduceOp::sum, reversed, 0, 40'003)));
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 1, 2}) {
    Machine machine(threads);
    Buffers bufs = original;
    rt::GraphBuilder b;
    comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
    machine.run(b);
    for (const auto& x : bufs)
      ASSERT_TRUE(same_bits(x, forward)) << threads << " threads";
  }
}

TEST(Collectives, LargeBuffersTakeTheStreamingPathsAndStayExact) {
  // Collectives touching more than 16 MiB write with streaming stores; odd sizes make the
  // copies start and end unaligned.
  Machine machine(2);
  SharedMemoryCommunicator comm;
  const int n = 3;
  const ProcessGroup g("three", {0, 1, 2});
  const std::size_t m = 400'003;
  Buffers in = random_buffers(n, m, 1), gathered(n, std::vector<float>(n * m));
  // The reduce-scatter outputs start one float past an allocation, off every vector boundary.
  Buffers scatter_in = random_buffers(n, n * m, 2), scattered(n, std::vector<float>(m + 1));
  std::vector<std::span<float>> scatter_out;
  for (auto& x : scattered)
    scatter_out.push_back(std::span<float>(x).subspan(1));
  Buffers a2a_in = random_buffers(n, n * m, 3), a2a_out(n, std::vector<float>(n * m));
  Buffers bcast = random_buffers(n, 6 * m + 1, 4);
  const std::vector<float> bcast_expect = bcast[1];
  std::vector<float> big_send = random_values(2'500'001, 5), big_recv(2'500'001);
  // Variable all-to-all: rank j sends 300 + 7 j rows of 1001 floats to every rank.
  const std::int64_t row = 1001;
  const auto rows = [](int from) { return std::int64_t{300} + 7 * from; };
  std::vector<std::vector<std::int64_t>> counts(n), received(n, std::vector<std::int64_t>(n));
  Buffers v_send, v_recv(n, std::vector<float>(static_cast<std::size_t>(n * 320 * row)));
  std::vector<VariableAllToAllBuffers> v;
  for (int r = 0; r < n; ++r) {
    counts[r].assign(n, rows(r));
    v_send.push_back(random_values(static_cast<std::size_t>(n * rows(r) * row), 6 + r));
  }
  for (int r = 0; r < n; ++r)
    v.push_back({v_send[r], &counts[r], v_recv[r], received[r]});
  rt::GraphBuilder b;
  comm.all_gather(b, g, spans<const float>(in), spans<float>(gathered));
  comm.reduce_scatter(b, g, spans<const float>(scatter_in), scatter_out, ReduceOp::max);
  comm.all_to_all(b, g, spans<const float>(a2a_in), spans<float>(a2a_out));
  comm.all_to_all_v(b, g, v, row);
  comm.broadcast(b, g, spans<float>(bcast), 1);
  comm.send_recv(b, 0, big_send, 2, big_recv);
  machine.run(b);
  std::vector<float> concat;
  for (const auto& x : in)
    concat.insert(concat.end(), x.begin(), x.end());
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(gathered[r], concat) << "all_gather rank " << r;
    EXPECT_TRUE(same_bits(std::vector<float>(scatter_out[r].begin(), scatter_out[r].end()),
                          reference_reduction(ReduceOp::max, scatter_in, r * m, m)))
        << "reduce_scatter rank " << r;
    std::vector<float> expect;
    for (int j = 0; j < n; ++j) {
      EXPECT_TRUE(std::equal(a2a_out[r].begin() + j * m, a2a_out[r].begin() + (j + 1) * m,
                             a2a_in[j].begin() + r * m))
          << "all_to_all " << r << " <- " << j;
      EXPECT_EQ(received[r][j], rows(j));
      const auto first = v_send[j].begin() + r * rows(j) * row;
      expect.insert(expect.end(), first, first + rows(j) * row);
    }
    EXPECT_TRUE(std::equal(expect.begin(), expect.end(), v_recv[r].begin()))
        << "all_to_all_v rank " << r;
    EXPECT_EQ(bcast[r], bcast_expect) << "broadcast rank " << r;
  }
  EXPECT_EQ(big_recv, big_send);
}

TEST(Collectives, InPlaceAllGatherAndReduceScatter) {
  // NCCL's in-place forms: the input is the rank's own block of the output (all-gather) or the
  // output is the rank's own block of the input (reduce-scatter).
  Machine machine(2);
  SharedMemoryCommunicator comm;
  const int n = 4;
  const ProcessGroup g = first_devices(n);
  const std::size_t m = 333;
  Buffers gather = random_buffers(n, n * m, 8), reduce_buffers = random_buffers(n, n * m, 9);
  std::vector<float> concat;
  for (int r = 0; r < n; ++r)
    concat.insert(concat.end(), gather[r].begin() + r * m, gather[r].begin() + (r + 1) * m);
  const Buffers reduce_original = reduce_buffers;
  std::vector<std::span<const float>> gather_in, reduce_in;
  std::vector<std::span<float>> gather_out, reduce_out;
  for (int r = 0; r < n; ++r) {
    gather_out.emplace_back(gather[r]);
    gather_in.push_back(gather_out.back().subspan(r * m, m));
    reduce_in.emplace_back(reduce_buffers[r]);
    reduce_out.push_back(std::span<float>(reduce_buffers[r]).subspan(r * m, m));
  }
  rt::GraphBuilder b;
  comm.all_gather(b, g, gather_in, gather_out);
  comm.reduce_scatter(b, g, reduce_in, reduce_out, ReduceOp::sum);
  machine.run(b);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(gather[r], concat) << "rank " << r;
    const std::vector<float> block(reduce_buffers[r].begin() + r * m,
                                   reduce_buffers[r].begin() + (r + 1) * m);
    EXPECT_TRUE(same_bits(block, reference_reduction(ReduceOp::sum, reduce_original, r * m, m)))
        << "rank " << r;
  }
}

TEST(Collectives, SubsetGroupOnScatteredDevices) {
  Machine machine(2);
  SharedMemoryCommunicator comm;
  const ProcessGroup g("odd", {1, 3, 6});
  EXPECT_EQ(g.rank_of(6), 2);
  Buffers bufs{{1, 2}, {10, 20}, {100, 200}};
  Buffers shards{{1}, {2}, {3}}, gathered(3, std::vector<float>(3));
  rt::GraphBuilder b;
  const auto reduce_ids = comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  const auto gather_ids = comm.all_gather(b, g, spans<const float>(shards), spans<float>(gathered));
  const rt::Graph graph = b.build();
  machine.run(graph);
  for (const auto& x : bufs)
    EXPECT_EQ(x, (std::vector<float>{111, 222}));
  for (const auto& x : gathered)
    EXPECT_EQ(x, (std::vector<float>{1, 2, 3}));
  // Member tasks sit on the group's devices, by rank, on their comm streams, and nowhere else.
  for (int r = 0; r < 3; ++r) {
    for (rt::TaskId id : {reduce_ids[r], gather_ids[r]}) {
      EXPECT_EQ(graph.tasks()[id].device, g.device(r));
      EXPECT_EQ(graph.tasks()[id].stream, rt::kCommStream);
      EXPECT_EQ(graph.tasks()[id].kind, rt::TaskKind::comm);
    }
  }
  EXPECT_EQ(graph.size(), 6u);
  EXPECT_EQ(graph.tasks().name(reduce_ids[1]), "all_reduce:odd[1]");
}

TEST(Collectives, OptionsNameTagAndPlaceTheTasks) {
  SharedMemoryCommunicator comm;
  Buffers bufs(2, std::vector<float>(4));
  rt::GraphBuilder b;
  const auto ids =
      comm.all_reduce(b, first_devices(2), spans<float>(bufs), ReduceOp::sum,
                      {.name = "grad.bucket3",
                       .tags = {.layer = 5, .micro_batch = 2, .phase = rt::Phase::backward},
                       .stream = "dp"});
  const rt::StreamId dp = b.stream("dp");
  const rt::Graph graph = b.build();
  EXPECT_EQ(graph.tasks().name(ids[1]), "grad.bucket3[1]");
  EXPECT_EQ(graph.tasks()[ids[1]].stream, dp);
  EXPECT_EQ(graph.tasks()[ids[1]].tags.layer, 5);
  EXPECT_EQ(graph.tasks()[ids[1]].tags.micro_batch, 2);
  EXPECT_EQ(graph.tasks()[ids[1]].tags.phase, rt::Phase::backward);
  EXPECT_EQ(graph.tasks().group_name(graph.tasks()[ids[0]].group), "grad.bucket3");
}

TEST(Collectives, CostHintsAreTheRingAlgorithmsBytesPerMember) {
  SharedMemoryCommunicator comm;
  const int n = 4;
  const ProcessGroup g = first_devices(n);
  const std::size_t s = 1000;  // elements
  Buffers full(n, std::vector<float>(s)), part(n, std::vector<float>(s / n));
  std::vector<std::vector<std::int64_t>> counts(n);
  std::vector<std::vector<std::int64_t>> received(n, std::vector<std::int64_t>(n));
  std::vector<VariableAllToAllBuffers> v;
  for (int r = 0; r < n; ++r)
    v.push_back({full[r], &counts[r], full[r], received[r]});
  rt::GraphBuilder b;
  const auto ar = comm.all_reduce(b, g, spans<float>(full), ReduceOp::sum);
  const auto ag = comm.all_gather(b, g, spans<const float>(part), spans<float>(full));
  const auto rs =
      comm.reduce_scatter(b, g, spans<const float>(full), spans<float>(part), ReduceOp::sum);
  const auto aa = comm.all_to_all(b, g, spans<const float>(full), spans<float>(full));
  const auto av = comm.all_to_all_v(b, g, v, 1);
  const auto bc = comm.broadcast(b, g, spans<float>(full), 1);
  const auto [send, recv] = comm.send_recv(b, 0, full[0], 3, full[3]);
  const auto bar = comm.barrier(b, g);
  const rt::Graph graph = b.build();
  const auto cost = [&](rt::TaskId t) { return graph.tasks()[t].cost; };
  const double bytes = 4.0 * s;
  for (int r = 0; r < n; ++r) {
    EXPECT_DOUBLE_EQ(cost(ar[r]).bytes, 2.0 * 3 / 4 * bytes);
    EXPECT_EQ(cost(ar[r]).messages, 6u);
    EXPECT_DOUBLE_EQ(cost(ag[r]).bytes, 3.0 / 4 * bytes);
    EXPECT_DOUBLE_EQ(cost(rs[r]).bytes, 3.0 / 4 * bytes);
    EXPECT_DOUBLE_EQ(cost(aa[r]).bytes, 3.0 / 4 * bytes);
    EXPECT_DOUBLE_EQ(cost(av[r]).bytes, 3.0 / 4 * bytes);
    EXPECT_EQ(cost(ag[r]).messages, 3u);
    EXPECT_EQ(cost(bar[r]).bytes, 0.0);
    EXPECT_EQ(cost(bar[r]).messages, 2u);
  }
  // The chain from root 1 ends at rank 0, which forwards nothing.
  EXPECT_EQ(cost(bc[0]).bytes, 0.0);
  EXPECT_DOUBLE_EQ(cost(bc[1]).bytes, bytes);
  EXPECT_DOUBLE_EQ(cost(bc[3]).bytes, bytes);
  EXPECT_DOUBLE_EQ(cost(send).bytes, bytes);
  EXPECT_EQ(cost(recv).bytes, 0.0);
  // Elements of another size (a 16-bit run predicted) move proportionally fewer bytes.
  rt::GraphBuilder half;
  const auto ar16 = comm.all_reduce(half, g, spans<float>(full), ReduceOp::sum,
                                    {.name = "bf16", .element_bytes = 2});
  const rt::Graph half_graph = half.build();
  EXPECT_DOUBLE_EQ(half_graph.tasks()[ar16[0]].cost.bytes, cost(ar[0]).bytes / 2);
  EXPECT_EQ(half_graph.tasks()[ar16[0]].cost.messages, 6u);
  // A group of one moves nothing.
  rt::GraphBuilder one;
  const std::vector<std::span<float>> only{full[0]};
  const auto solo = comm.all_reduce(one, first_devices(1), only, ReduceOp::sum);
  EXPECT_EQ(one.build().tasks()[solo[0]].cost.bytes, 0.0);
}

TEST(Collectives, SendRecvDeliversBeforeTheReceiversNextTask) {
  Machine machine(1);
  SharedMemoryCommunicator comm;
  for (std::size_t size : {0, 1, 5000}) {
    std::vector<float> a = random_values(size, 3), c(size, 0.f);
    std::vector<float> seen;
    rt::GraphBuilder b;
    const auto [send, recv] = comm.send_recv(b, 2, a, 5, c);
    const auto done = b.add({.device = 5}, [&](rt::TaskContext&) { seen = c; });
    b.precede(recv, done);
    const rt::Graph graph = b.build();
    EXPECT_EQ(graph.tasks()[send].device, 2u);
    EXPECT_EQ(graph.tasks()[recv].device, 5u);
    machine.run(graph);
    EXPECT_EQ(seen, a) << size;
  }
}

TEST(Collectives, EightDevicesOnOneThreadRunManyCollectivesInOrder) {
  Machine machine(1);
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(8);
  // Rank r starts with r + 1 everywhere: the first sum gives 36 on every rank, the maxes keep
  // it, the last sum gives 8 x 36. Out of order on any device, the result would differ.
  Buffers bufs;
  for (int r = 0; r < 8; ++r)
    bufs.emplace_back(100, static_cast<float>(r + 1));
  rt::GraphBuilder b;
  comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  for (int i = 0; i < 20; ++i)
    comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::max);
  comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  machine.run(b);
  for (const auto& x : bufs)
    EXPECT_EQ(x, std::vector<float>(100, 8 * 36.f));
}

TEST(Collectives, LinkModelHoldsCompletionAndTheVirtualClockReplaysIt) {
  // 4 ranks all-reduce 1 Mi floats over a 1 GB/s link with 50 us latency: each member sends
  // 2 (n-1)/n x 4 MiB in 2 (n-1) messages, and completion is held that long after the last
  // arrival.
  const LinkModel links = LinkModel::accelerator({.latency = 50'000, .bytes_per_second = 1e9});
  const MachineModel model({0, 0, 0, 0, 0, 0, 0, 0}, 1e12, links);
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(4);
  Buffers bufs(4, std::vector<float>(1 << 20, 1.f));
  rt::GraphBuilder b;
  const auto members = comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  const rt::Graph graph = b.build();
  const rt::Nanos modelled = model.duration(graph.tasks(), members[0]);
  EXPECT_EQ(modelled, 6 * 50'000 + static_cast<rt::Nanos>(1.5 * 4 * (1 << 20)));
  Machine machine(2);
  // A hold is never shorter than modelled; nothing else about wall time is asserted.
  const rt::RunResult wall = machine.run(graph, {.link_model = &model});
  EXPECT_GE(wall.wall_time, modelled);
  EXPECT_EQ(bufs[3][12345], 4.f);
  // The same graph on the virtual clock, work executed: exactly the modelled time.
  rt::VirtualClock clock(model, {.execute = true});
  const rt::VirtualRunResult replay = clock.run(graph);
  EXPECT_EQ(replay.makespan, modelled);
  EXPECT_EQ(bufs[0][0], 16.f);
}

TEST(Collectives, VariableAllToAllIsTimedByItsRealSplit) {
  // The hint assumes a member sends its whole send buffer; once run, each member reports what
  // it really moved: the larger of its off-rank sends and receives. Rank 0 sends 100 rows of
  // 4 floats to rank 1 and rank 1 sends 10 rows back, out of buffers of 1000 rows.
  const LinkModel links = LinkModel::accelerator({.latency = 1'000, .bytes_per_second = 1e9});
  const MachineModel model({0, 0}, 1e12, links);
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(2);
  constexpr std::int64_t row = 4;
  Buffers send(2, std::vector<float>(1000 * row, 1.f)), recv(2, std::vector<float>(1000 * row));
  std::vector<std::int64_t> counts0{0, 100}, counts1{10, 0}, got0(2), got1(2);
  const std::vector<VariableAllToAllBuffers> bufs{{send[0], &counts0, recv[0], got0},
                                                  {send[1], &counts1, recv[1], got1}};
  rt::GraphBuilder b;
  const auto members = comm.all_to_all_v(b, g, bufs, row);
  const rt::Graph graph = b.build();
  EXPECT_EQ(model.duration(graph.tasks(), members[0]), 1'000 + 8'000);  // half of 1000 rows
  rt::VirtualClock clock(model, {.execute = true});
  EXPECT_EQ(clock.run(graph).makespan, 1'000 + 100 * row * 4);
  EXPECT_EQ(got1, (std::vector<std::int64_t>{100, 0}));
  // The executor's link model holds completion for the real split too (never less).
  Machine machine(2);
  EXPECT_GE(machine.run(graph, {.link_model = &model}).wall_time, 1'000 + 100 * row * 4);
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no std::invalid_argument";
}

#define EXPECT_ERROR(call, text) EXPECT_PRED_FORMAT2(::testing::IsSubstring, text, error_of(call))

TEST(Collectives, BadGroupsAreRefusedWithTheRule) {
  EXPECT_ERROR([] { ProcessGroup("dup", {0, 1, 0}); }, "lists device 0 twice (ranks 0 and 2)");
  EXPECT_ERROR([] { ProcessGroup("none", {}); }, "process group 'none' has no devices");
  const ProcessGroup g("tp", {2, 4});
  EXPECT_ERROR([&] { g.rank_of(3); }, "device 3 is not in process group 'tp' (devices 2, 4)");
}

// bf16 values all-gathered two to an element (packed_halves), as a bf16 stage 3 gathers its
// parameters: every rank receives the bits the fp32 all-gather of the same values widened gives
// (bf16 is fp32's upper half), NaN payloads, subnormals, -0 and infinities included (and pairs
// that make signalling NaNs as floats), over the vector strips and their ragged tails, into
// separate buffers and in place. An odd count or a misaligned buffer is refused.
TEST(Collectives, PackedBf16AllGatherGivesTheFp32PathsValues) {
  Machine machine(2);
  SharedMemoryCommunicator comm;
  const int n = 4;
  const ProcessGroup g = first_devices(n);
  const std::uint16_t special[] = {0x7fc1, 0xffa5, 0x0001, 0x807f, 0x8000, 0x7f80, 0xff80, 0x3f80};
  const auto widened = [](std::uint16_t half) {
    return std::bit_cast<float>(static_cast<std::uint32_t>(half) << 16);
  };
  for (const std::size_t m : {std::size_t{2}, std::size_t{16}, std::size_t{1538}}) {
    SCOPED_TRACE(m);
    std::mt19937 random(static_cast<unsigned>(m));
    std::vector<std::vector<std::uint16_t>> in(n, std::vector<std::uint16_t>(m)),
        out(n, std::vector<std::uint16_t>(m * n, 0xdead));
    Buffers wide_in(n, std::vector<float>(m)), wide_out(n, std::vector<float>(m * n, -1.f));
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < m; ++i) {
        in[r][i] = i % 7 == 3 ? special[(i + r) % std::size(special)]
                              : static_cast<std::uint16_t>(random());
        wide_in[r][i] = widened(in[r][i]);
      }
    std::vector<std::span<const float>> packed_in;
    std::vector<std::span<float>> packed_out;
    for (int r = 0; r < n; ++r) {
      packed_in.push_back(
          gathered_elements(packed_halves(std::span<const std::uint16_t>(in[r]), "shard")));
      packed_out.push_back(
          gathered_elements(packed_halves(std::span<std::uint16_t>(out[r]), "gathered")));
      EXPECT_EQ(packed_in.back().size(), m / 2);
    }
    rt::GraphBuilder b;
    comm.all_gather(b, g, packed_in, packed_out);
    comm.all_gather(b, g, spans<const float>(wide_in), spans<float>(wide_out));
    machine.run(b);
    for (int r = 0; r < n; ++r) {
      std::vector<float> got(m * n);
      for (std::size_t i = 0; i < got.size(); ++i)
        got[i] = widened(out[r][i]);
      EXPECT_TRUE(same_bits(got, wide_out[r])) << "rank " << r;
    }
    // In place, as the distributed optimizer gathers the replicas' rounded shards: each rank's
    // input its own block of the output, which it keeps; the others' blocks arrive bit for bit.
    std::vector<std::vector<std::uint16_t>> inplace(n, std::vector<std::uint16_t>(m * n, 0xbeef));
    std::vector<std::span<const float>> own;
    std::vector<std::span<float>> whole;
    for (int r = 0; r < n; ++r) {
      std::copy(in[r].begin(), in[r].end(),
                inplace[r].begin() + static_cast<std::ptrdiff_t>(r * m));
      const std::span<std::uint16_t> all(inplace[r]);
      own.push_back(gathered_elements(
          packed_halves(std::span<const std::uint16_t>(all.subspan(r * m, m)), "own")));
      whole.push_back(gathered_elements(packed_halves(all, "whole")));
    }
    rt::GraphBuilder in_place;
    comm.all_gather(in_place, g, own, whole);
    machine.run(in_place);
    for (int r = 0; r < n; ++r)
      EXPECT_EQ(inplace[r], out[r]) << "rank " << r << " in place";
  }
  std::vector<std::uint16_t> odd(3), even(6);
  EXPECT_ERROR([&] { (void)packed_halves(std::span<std::uint16_t>(odd), "shard"); },
               "shard: 16-bit values are moved two to a 4-byte element, so a buffer of 3");
  EXPECT_ERROR([&] { (void)packed_halves(std::span<std::uint16_t>(even).subspan(1, 2), "slot"); },
               "at a 4-byte aligned address");
}

TEST(Collectives, BadBuffersAreRefusedAtBuildTimeWithTheRule) {
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(3);
  Buffers three(3, std::vector<float>(4)), two(2, std::vector<float>(4));
  rt::GraphBuilder b;
  EXPECT_ERROR([&] { comm.all_reduce(b, g, spans<float>(two), ReduceOp::sum); },
               "all_reduce over group 'g' of 3 ranks got 2 buffers: pass one per rank");
  three[2].resize(5);
  EXPECT_ERROR([&] { comm.all_reduce(b, g, spans<float>(three), ReduceOp::sum); },
               "rank 2 (device 2) has an input/output buffer of 5 elements where 4 are needed");
  EXPECT_ERROR([&] { comm.broadcast(b, g, spans<float>(three), 0); },
               "rank 2 (device 2) has an input/output buffer of 5 elements where 4 are needed");
  three[2].resize(4);
  EXPECT_ERROR([&] { comm.broadcast(b, g, spans<float>(three), 3); },
               "root rank 3 is outside [0, 3)");
  EXPECT_ERROR([&] { comm.broadcast(b, g, spans<float>(three), -1); },
               "root rank -1 is outside [0, 3)");
  Buffers in(3, std::vector<float>(2)), out(3, std::vector<float>(5));
  EXPECT_ERROR([&] { comm.all_gather(b, g, spans<const float>(in), spans<float>(out)); },
               "has an output of 5 elements where 6 are needed (each output holds group size x "
               "input = 3 x 2)");
  EXPECT_ERROR(
      [&] { comm.reduce_scatter(b, g, spans<const float>(out), spans<float>(in), ReduceOp::sum); },
      "has an input of 5 elements where 6 are needed (each input holds group size x "
      "output = 3 x 2)");
  EXPECT_ERROR([&] { comm.all_to_all(b, g, spans<const float>(out), spans<float>(out)); },
               "rank 0's 5 elements cannot be split into 3 equal blocks");
  Buffers six(3, std::vector<float>(6));
  six[1].resize(9);
  EXPECT_ERROR([&] { comm.all_to_all(b, g, spans<const float>(six), spans<float>(six)); },
               "rank 1 (device 1) has an input of 9 elements where 6 are needed");
  EXPECT_ERROR([&] { comm.all_gather(b, g, spans<const float>(in), spans<float>(two)); },
               "got 2 outputs");
  EXPECT_ERROR([&] { comm.send_recv(b, 1, in[0], 1, out[0]); }, "to itself");
  EXPECT_ERROR([&] { comm.send_recv(b, 0, in[0], 1, out[0]); },
               "sending 2 elements into a buffer of 5");
  std::vector<std::int64_t> counts(3), short_counts(2);
  std::vector<VariableAllToAllBuffers> v{{in[0], &counts, out[0], counts},
                                         {in[1], &counts, out[1], counts},
                                         {in[2], nullptr, out[2], counts}};
  EXPECT_ERROR([&] { comm.all_to_all_v(b, g, v, 1); }, "rank 2 (device 2) has no send_counts");
  v[2] = {in[2], &counts, out[2], short_counts};
  EXPECT_ERROR([&] { comm.all_to_all_v(b, g, v, 1); },
               "rank 2 (device 2) has room for 2 receive counts; give it one per rank, 3");
  v[2] = {in[2], &counts, out[2], counts};
  EXPECT_ERROR([&] { comm.all_to_all_v(b, g, v, 0); }, "a row must hold at least 1 element");
  // Nothing half-built was left behind by the refused calls.
  EXPECT_EQ(b.size(), 0u);
}

TEST(Collectives, VariableGatherAndScatterRefuseBadCountsNamingThem) {
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(2);
  std::vector<float> a(6), c(6), wide(12), narrow(2);
  std::int64_t rows = 2;
  std::vector<std::int64_t> two(2), three(3);
  rt::GraphBuilder b;
  std::vector<VariableGatherBuffers> gather{{a, &rows, wide, two}, {c, nullptr, wide, two}};
  EXPECT_ERROR([&] { comm.all_gather_v(b, g, gather, 3); }, "rank 1 (device 1) has no send_rows");
  gather[1] = {c, &rows, wide, three};
  EXPECT_ERROR([&] { comm.all_gather_v(b, g, gather, 3); },
               "has room for 3 receive counts; give it one per rank, 2");
  gather[1] = {c, &rows, wide, two};
  EXPECT_ERROR([&] { comm.all_gather_v(b, g, gather, 0); }, "a row must hold at least 1 element");
  std::vector<VariableScatterBuffers> scatter{{wide, &two, a}, {wide, nullptr, c}};
  EXPECT_ERROR([&] { comm.reduce_scatter_v(b, g, scatter, 3); },
               "rank 1 (device 1) has no block rows");
  EXPECT_EQ(b.size(), 0u);
  // At run time: a block larger than its sender's buffer, and counts members disagree on.
  Machine machine(2);
  {
    rt::GraphBuilder run;
    std::int64_t too_many = 3;  // 9 elements from a buffer of 6
    std::vector<VariableGatherBuffers> bad{{a, &too_many, wide, two}, {c, &rows, wide, three}};
    bad[1].recv_rows = std::span<std::int64_t>(two);
    comm.all_gather_v(run, g, bad, 3, {.name = "gather"});
    try {
      machine.run(run);
      ADD_FAILURE() << "expected the run to fail";
    } catch (const rt::TaskError& e) {
      EXPECT_PRED_FORMAT2(::testing::IsSubstring, "rank 0 sends 3 rows of 3 elements", e.what());
    }
  }
  {
    rt::GraphBuilder run;
    std::vector<std::int64_t> mine{1, 1}, theirs{2, 0};
    std::vector<VariableScatterBuffers> bad{{wide, &mine, a}, {wide, &theirs, c}};
    comm.reduce_scatter_v(run, g, bad, 3, {.name = "scatter"});
    try {
      machine.run(run);
      ADD_FAILURE() << "expected the run to fail";
    } catch (const rt::TaskError& e) {
      EXPECT_PRED_FORMAT2(::testing::IsSubstring, "disagree on the blocks' rows", e.what());
    }
  }
}

// Runs a two-rank variable all-to-all whose counts are only wrong at run time.
rt::TaskError run_time_error(std::vector<std::int64_t> counts0, std::vector<std::int64_t> counts1,
                             std::size_t recv1_capacity) {
  Machine machine(2);
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(2);
  std::vector<std::int64_t> filled0, filled1, r0(2), r1(2);
  std::vector<float> send0(8), send1(8), recv0(8), recv1(recv1_capacity);
  std::vector<VariableAllToAllBuffers> bufs{{send0, &filled0, recv0, r0},
                                            {send1, &filled1, recv1, r1}};
  rt::GraphBuilder b;
  const auto ids = comm.all_to_all_v(b, g, bufs, 1, {.name = "dispatch"});
  const rt::TaskId route = b.add({.device = 0, .name = "route"}, [&](rt::TaskContext&) {
    filled0 = counts0;
    filled1 = counts1;
  });
  b.precede(route, ids[0]);
  b.precede(route, ids[1]);
  try {
    machine.run(b);
  } catch (const rt::TaskError& e) {
    return e;
  }
  ADD_FAILURE() << "expected the run to fail";
  return rt::TaskError("", rt::kNoTask, nullptr, "");
}

TEST(Collectives, RunTimeCountErrorsCancelTheRunAndNameTheTask) {
  {
    const rt::TaskError e = run_time_error({0, 4}, {0, 0}, 2);  // rank 1 has room for 2
    EXPECT_EQ(e.task_name(), "dispatch[1]");
    EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                        "rank 1 receives 4 elements but its receive buffer holds 2", e.what());
  }
  {
    const rt::TaskError e = run_time_error({1, 1, 1}, {0, 0}, 8);  // three counts for two ranks
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "dispatch[", e.task_name());
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "rank 0 has 3 send counts, needs one per rank (2)",
                        e.what());
  }
  {
    const rt::TaskError e = run_time_error({0, 0}, {5, 4}, 8);  // 9 rows from 8 elements
    EXPECT_PRED_FORMAT2(::testing::IsSubstring,
                        "rank 1 sends 9 rows of 1 elements but its send buffer holds 8", e.what());
  }
  {
    const rt::TaskError e = run_time_error({0, 0}, {-1, 0}, 8);
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "rank 1 sends a negative count -1", e.what());
  }
}

TEST(Collectives, DifferentOrdersOnDifferentDevicesAreACycle) {
  // Device 0 runs A before B (its comm stream's order); device 1 is made to run B before A.
  // Neither collective could ever gather all its members: build() refuses the graph.
  SharedMemoryCommunicator comm;
  Buffers a(2, std::vector<float>(4)), c(2, std::vector<float>(4));
  rt::GraphBuilder b;
  const auto ta = comm.all_reduce(b, ProcessGroup("A", {0, 1}), spans<float>(a), ReduceOp::sum);
  const auto tb = comm.all_reduce(b, ProcessGroup("B", {0, 1}), spans<float>(c), ReduceOp::sum);
  b.precede(tb[1], ta[1]);
  EXPECT_THROW(b.build(), rt::GraphError);
}

// Issued one member at a time, in an order that interleaves ranks and groups, a rank program's
// collectives give the results and costs of the whole calls.
TEST(CollectiveMatcher, MembersIssuedOneAtATimeMatchByGroupAndOrder) {
  Machine machine(2);
  SharedMemoryCommunicator comm;
  const ProcessGroup a("a", {0, 1, 2}), pair("b", {1, 2});
  Buffers first = random_buffers(3, 100, 1), second = random_buffers(3, 100, 2);
  Buffers other = random_buffers(2, 50, 3);
  const std::vector<float> want_first = reference_reduction(ReduceOp::sum, first, 0, 100);
  const std::vector<float> want_second = reference_reduction(ReduceOp::max, second, 0, 100);
  const std::vector<float> want_other = reference_reduction(ReduceOp::sum, other, 0, 50);
  rt::GraphBuilder b;
  CollectiveMatcher matcher(b, comm);
  std::vector<rt::TaskId> ids;
  // Each device issues its own program: device 2 issues group b's collective before group a's,
  // device 1 the other way round; within group a, every member issues "first" before "second".
  for (int device = 2; device >= 0; --device) {
    auto issue_a = [&] {
      ids.push_back(matcher.all_reduce(a, device, first[device], ReduceOp::sum, {.name = "first"}));
      ids.push_back(
          matcher.all_reduce(a, device, second[device], ReduceOp::max, {.name = "second"}));
    };
    auto issue_b = [&] {
      if (device == 0) return;
      ids.push_back(matcher.all_reduce(pair, device - 1, other[device - 1], ReduceOp::sum,
                                       {.name = "other", .stream = "b"}));
    };
    if (device == 2) {
      issue_b();
      issue_a();
    } else {
      issue_a();
      issue_b();
    }
    EXPECT_EQ(b.size(), ids.size()) << "each member's task exists as soon as it issues";
  }
  EXPECT_TRUE(matcher.open_collectives().empty());
  matcher.finish();
  const rt::Graph graph = b.build();
  EXPECT_EQ(graph.tasks().group_count(), 3u);
  machine.run(graph);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(same_bits(first[r], want_first)) << r;
    EXPECT_TRUE(same_bits(second[r], want_second)) << r;
  }
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(same_bits(other[r], want_other)) << r;
  // A member's cost is its own: the same as the whole call's.
  rt::GraphBuilder whole;
  const auto whole_ids = comm.all_reduce(whole, a, spans<float>(first), ReduceOp::sum);
  const rt::Graph whole_graph = whole.build();
  for (rt::TaskId t = 0; t < graph.size(); ++t) {
    if (graph.tasks().name(t).starts_with("first")) {
      EXPECT_EQ(graph.tasks()[t].cost.bytes, whole_graph.tasks()[whole_ids[0]].cost.bytes);
    }
  }
}

TEST(CollectiveMatcher, SendsMeetTheirReceivesInOrderPerPair) {
  Machine machine(1);
  SharedMemoryCommunicator comm;
  std::vector<float> x = random_values(10, 4), y = random_values(10, 5), gx(10), gy(10);
  rt::GraphBuilder b;
  CollectiveMatcher matcher(b, comm);
  // The receiver issues first; the k-th send of a pair meets its k-th receive.
  const rt::TaskId rx = matcher.receive(0, 1, gx, {.name = "x"});
  const rt::TaskId ry = matcher.receive(0, 1, gy, {.name = "y"});
  const rt::TaskId sx = matcher.send(0, 1, x, {.name = "x"});
  const rt::TaskId sy = matcher.send(0, 1, y, {.name = "y"});
  matcher.finish();
  const rt::Graph graph = b.build();
  EXPECT_EQ(graph.tasks()[sx].group, graph.tasks()[rx].group);
  EXPECT_EQ(graph.tasks()[sy].group, graph.tasks()[ry].group);
  EXPECT_GT(graph.tasks()[sx].cost.bytes, 0.0);
  EXPECT_EQ(graph.tasks()[rx].cost.bytes, 0.0);
  machine.run(graph);
  EXPECT_EQ(gx, x);
  EXPECT_EQ(gy, y);
}

TEST(CollectiveMatcher, MembersIssuingDifferentCollectivesAreRefusedNamingBoth) {
  SharedMemoryCommunicator comm;
  Buffers bufs(2, std::vector<float>(4));
  rt::GraphBuilder b;
  CollectiveMatcher matcher(b, comm);
  const ProcessGroup g = first_devices(2);
  matcher.all_reduce(g, 0, bufs[0], ReduceOp::sum, {.name = "grads"});
  EXPECT_ERROR(
      [&] { matcher.all_gather(g, 1, bufs[1], bufs[1], {.name = "activations"}); },
      "member 1 issued all_gather 'activations' where another member issued all_reduce 'grads'");
  EXPECT_ERROR([&] { matcher.all_reduce(g, 2, bufs[1], ReduceOp::sum); },
               "issued by member 2: a member is its rank in the group, in [0, 2)");
}

// Every op goes through one call, a CollectiveCall with the buffers its op uses; the named calls
// are that call. Its members' streams carry the kind the caller gives them.
TEST(CollectiveMatcher, AnyOpIsIssuedThroughOneCall) {
  Machine machine(1);
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(3);
  Buffers bufs = random_buffers(3, 40, 7);
  const std::vector<float> want = reference_reduction(ReduceOp::max, bufs, 0, 40);
  rt::GraphBuilder b;
  CollectiveMatcher matcher(b, comm);
  std::vector<rt::TaskId> ids;
  for (int r = 0; r < 3; ++r)
    ids.push_back(matcher.issue({.op = CollectiveOp::all_reduce, .reduce = ReduceOp::max}, g, r,
                                {.output = bufs[static_cast<std::size_t>(r)]},
                                {.name = "any", .stream = "kinded", .stream_kind = 5}));
  matcher.finish();
  rt::GraphBuilder named;
  Buffers copies = bufs;
  const auto named_ids = comm.all_reduce(named, g, spans<float>(copies), ReduceOp::max);
  const rt::Graph graph = b.build(), named_graph = named.build();
  EXPECT_EQ(graph.tasks().stream_kind(graph.tasks()[ids[0]].stream), 5);
  EXPECT_EQ(graph.tasks()[ids[1]].cost.bytes, named_graph.tasks()[named_ids[1]].cost.bytes);
  EXPECT_EQ(graph.tasks()[ids[1]].cost.messages, named_graph.tasks()[named_ids[1]].cost.messages);
  machine.run(graph);
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(same_bits(bufs[static_cast<std::size_t>(r)], want)) << r;
  rt::GraphBuilder bad;
  CollectiveMatcher bad_matcher(bad, comm);
  EXPECT_ERROR([&] { bad_matcher.issue({.op = static_cast<CollectiveOp>(200)}, g, 0, {}); },
               "issued op 200, which is not a CollectiveOp");
  EXPECT_EQ(bad.size(), 0u);
}

TEST(CollectiveMatcher, AMemberThatNeverIssuesIsNamedAndItsCollectiveCannotRun) {
  Machine machine(1);
  SharedMemoryCommunicator comm;
  Buffers bufs(3, std::vector<float>(4));
  rt::GraphBuilder b;
  CollectiveMatcher matcher(b, comm);
  const ProcessGroup g = first_devices(3);
  matcher.all_reduce(g, 0, bufs[0], ReduceOp::sum, {.name = "loss"});
  matcher.all_reduce(g, 2, bufs[2], ReduceOp::sum, {.name = "loss"});
  ASSERT_EQ(matcher.open_collectives().size(), 1u);
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "members 0, 2 of 3 issued it",
                      matcher.open_collectives()[0]);
  try {
    matcher.finish();
    ADD_FAILURE() << "expected finish() to refuse the open collective";
  } catch (const std::logic_error& e) {
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "all_reduce 'loss' over group 'g'", e.what());
  }
  // A graph holding only some members (the others built elsewhere) builds, but the shared
  // memory backend cannot run its open collective: the run fails naming it.
  try {
    machine.run(b);
    ADD_FAILURE() << "expected the run to fail";
  } catch (const rt::TaskError& e) {
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "never issued", e.what());
  }
}

}  // namespace
}  // namespace weave::devices
