// Shared-memory collectives against serial references: every operation for group sizes 1 to 8,
// odd and empty sizes, uneven all-to-all splits, 8 devices on one worker thread, bitwise
// reproducibility, and clear errors for bad input.
#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::devices {
namespace {

// Eight single-slot device arenas under a thread limit, and an executor over them.
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

std::vector<float> random_values(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-10.f, 10.f);
  std::vector<float> v(n);
  for (auto& x : v)
    x = dist(gen);
  return v;
}

ProcessGroup first_devices(int n) {
  std::vector<rt::DeviceId> devices(static_cast<std::size_t>(n));
  std::iota(devices.begin(), devices.end(), 0u);
  return ProcessGroup("g", devices);
}

template <typename T>
std::vector<std::span<T>> spans(std::vector<std::vector<float>>& v) {
  std::vector<std::span<T>> s;
  for (auto& x : v)
    s.emplace_back(x);
  return s;
}

// (group size, threads)
class Collective : public ::testing::TestWithParam<std::tuple<int, int>> {
 protected:
  int n() const { return std::get<0>(GetParam()); }
  int threads() const { return std::get<1>(GetParam()); }
  SharedMemoryCommunicator comm;
};

// Sizes: empty, one element, odd, and more than one 4096-element reduction block per rank.
const std::size_t kSizes[] = {0, 1, 7, 1000, 40'003};

TEST_P(Collective, AllReduceSumAndMaxMatchRankOrderReduction) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    for (std::size_t size : kSizes) {
      std::vector<std::vector<float>> bufs;
      for (int r = 0; r < n(); ++r)
        bufs.push_back(random_values(size, 100 * r + static_cast<unsigned>(size)));
      std::vector<float> expect = bufs[0];
      for (int r = 1; r < n(); ++r)
        for (std::size_t i = 0; i < size; ++i)
          expect[i] =
              op == ReduceOp::sum ? expect[i] + bufs[r][i] : std::max(expect[i], bufs[r][i]);
      rt::GraphBuilder b;
      const auto s = spans<float>(bufs);
      comm.all_reduce(b, g, s, op);
      machine.run(b);
      for (int r = 0; r < n(); ++r)
        ASSERT_EQ(bufs[r], expect) << "rank " << r << ", size " << size;  // bitwise
    }
  }
}

TEST_P(Collective, AllGatherConcatenatesInRankOrder) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  for (std::size_t m : {std::size_t{0}, std::size_t{1}, std::size_t{13}}) {
    std::vector<std::vector<float>> in, out(n(), std::vector<float>(m * n(), -1.f));
    std::vector<float> expect;
    for (int r = 0; r < n(); ++r) {
      in.push_back(random_values(m, r + 1));
      expect.insert(expect.end(), in.back().begin(), in.back().end());
    }
    rt::GraphBuilder b;
    comm.all_gather(b, g, spans<const float>(in), spans<float>(out));
    machine.run(b);
    for (int r = 0; r < n(); ++r)
      EXPECT_EQ(out[r], expect) << "rank " << r;
  }
}

TEST_P(Collective, ReduceScatterGivesEachRankItsReducedBlock) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  for (std::size_t m : {std::size_t{0}, std::size_t{1}, std::size_t{5000}}) {
    std::vector<std::vector<float>> in, out(n(), std::vector<float>(m));
    for (int r = 0; r < n(); ++r)
      in.push_back(random_values(m * n(), 7 * r + 3));
    rt::GraphBuilder b;
    comm.reduce_scatter(b, g, spans<const float>(in), spans<float>(out), ReduceOp::sum);
    machine.run(b);
    for (int r = 0; r < n(); ++r)
      for (std::size_t i = 0; i < m; ++i) {
        float acc = in[0][r * m + i];
        for (int j = 1; j < n(); ++j)
          acc += in[j][r * m + i];
        ASSERT_EQ(out[r][i], acc) << "rank " << r << " element " << i;
      }
  }
}

TEST_P(Collective, AllToAllTransposesBlocks) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  const std::size_t m = 3;
  std::vector<std::vector<float>> in, out(n(), std::vector<float>(m * n()));
  for (int r = 0; r < n(); ++r)
    in.push_back(random_values(m * n(), 11 * r + 5));
  rt::GraphBuilder b;
  comm.all_to_all(b, g, spans<const float>(in), spans<float>(out));
  machine.run(b);
  for (int r = 0; r < n(); ++r)
    for (int j = 0; j < n(); ++j)
      for (std::size_t i = 0; i < m; ++i)
        ASSERT_EQ(out[r][j * m + i], in[j][r * m + i]);
}

TEST_P(Collective, VariableAllToAllWithUnevenAndZeroSplits) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  const std::int64_t row = 2;
  // Rank r sends (r + 2 j) % 3 rows to rank j: zeros included. The counts are filled by a task
  // that runs before the collective, as a router would.
  std::vector<std::vector<std::int64_t>> send_counts(n()), recv_counts(n());
  std::vector<std::vector<float>> send(n()), recv(n(), std::vector<float>(64 * row, -1.f));
  rt::GraphBuilder b;
  std::vector<rt::TaskId> fill;
  for (int r = 0; r < n(); ++r) {
    send[r] = random_values(static_cast<std::size_t>(3 * n() * row), 17 * r + 1);
    fill.push_back(
        b.add({.device = static_cast<rt::DeviceId>(r), .name = "route"}, [&, r](rt::TaskContext&) {
          send_counts[r].clear();
          for (int j = 0; j < n(); ++j)
            send_counts[r].push_back((r + 2 * j) % 3);
        }));
  }
  std::vector<VariableAllToAllBuffers> bufs;
  for (int r = 0; r < n(); ++r)
    bufs.push_back({send[r], &send_counts[r], recv[r], &recv_counts[r]});
  const auto members = comm.all_to_all_v(b, g, bufs, row);
  for (int r = 0; r < n(); ++r)
    b.precede(fill[r], members[r]);
  machine.run(b);
  for (int r = 0; r < n(); ++r) {
    std::vector<float> expect;
    for (int j = 0; j < n(); ++j) {
      EXPECT_EQ(recv_counts[r][j], (j + 2 * r) % 3);
      std::int64_t from = 0;
      for (int k = 0; k < r; ++k)
        from += (j + 2 * k) % 3;
      const auto first = send[j].begin() + from * row;
      expect.insert(expect.end(), first, first + (j + 2 * r) % 3 * row);
    }
    EXPECT_TRUE(std::equal(expect.begin(), expect.end(), recv[r].begin())) << "rank " << r;
  }
}

TEST_P(Collective, BroadcastCopiesTheRootsBuffer) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  const int root = n() - 1;
  std::vector<std::vector<float>> bufs;
  for (int r = 0; r < n(); ++r)
    bufs.push_back(random_values(77, r + 40));
  const std::vector<float> expect = bufs[root];
  rt::GraphBuilder b;
  comm.broadcast(b, g, spans<float>(bufs), root);
  machine.run(b);
  for (int r = 0; r < n(); ++r)
    EXPECT_EQ(bufs[r], expect);
}

TEST_P(Collective, ResultsAreBitwiseIdenticalAcrossRuns) {
  Machine machine(threads());
  const ProcessGroup g = first_devices(n());
  std::vector<std::vector<float>> original;
  for (int r = 0; r < n(); ++r)
    original.push_back(random_values(9001, r + 90));
  std::vector<std::vector<float>> bufs = original;
  rt::GraphBuilder b;
  // Restore the inputs, then reduce: the same graph run three times.
  std::vector<rt::TaskId> restore;
  for (int r = 0; r < n(); ++r)
    restore.push_back(b.add({.device = static_cast<rt::DeviceId>(r), .stream = b.stream("comm")},
                            [&, r](rt::TaskContext&) { bufs[r] = original[r]; }));
  comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  const rt::Graph graph = b.build();
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    machine.run(graph);
    if (run == 0) first = bufs[0];
    for (int r = 0; r < n(); ++r)
      ASSERT_EQ(bufs[r], first) << "run " << run << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(GroupsAndThreads, Collective,
                         ::testing::Combine(::testing::Range(1, 9), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_threads" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Collectives, SubsetGroupOnScatteredDevices) {
  Machine machine(2);
  SharedMemoryCommunicator comm;
  const ProcessGroup g("odd", {1, 3, 6});
  std::vector<std::vector<float>> bufs{{1, 2}, {10, 20}, {100, 200}};
  rt::GraphBuilder b;
  const auto members = comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  machine.run(b);
  for (const auto& x : bufs)
    EXPECT_EQ(x, (std::vector<float>{111, 222}));
  // The member tasks sit on the group's devices, on their comm streams.
  rt::GraphBuilder b2;
  const auto ids = comm.all_reduce(b2, g, spans<float>(bufs), ReduceOp::sum);
  const rt::Graph graph = b2.build();
  EXPECT_EQ(graph.tasks()[ids[2]].device, 6u);
  EXPECT_EQ(graph.tasks()[ids[2]].kind, rt::TaskKind::comm);
  EXPECT_EQ(graph.tasks().name(ids[1]), "all_reduce:odd[1]");
}

TEST(Collectives, SendRecvAndBarrier) {
  Machine machine(1);
  SharedMemoryCommunicator comm;
  std::vector<float> a{1, 2, 3}, c(3, 0.f);
  int after = 0;
  rt::GraphBuilder b;
  const auto [send, recv] = comm.send_recv(b, 2, a, 5, c);
  const auto done = b.add({.device = 5}, [&](rt::TaskContext&) { after = static_cast<int>(c[2]); });
  b.precede(recv, done);
  comm.barrier(b, first_devices(8));
  machine.run(b);
  EXPECT_EQ(c, a);
  EXPECT_EQ(after, 3);
  (void)send;
}

TEST(Collectives, EightDevicesOnOneThreadRunMany) {
  Machine machine(1);
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(8);
  std::vector<std::vector<float>> bufs(8, std::vector<float>(100, 1.f));
  rt::GraphBuilder b;
  for (int i = 0; i < 20; ++i)
    comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::max);
  comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  machine.run(b);
  for (const auto& x : bufs)
    EXPECT_EQ(x[99], 8.f);
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

TEST(Collectives, LinkModelHoldsCompletionAndTheVirtualClockReplaysIt) {
  // 4 ranks all-reduce 1 Mi floats over a 1 GB/s link with 50 us latency: each member sends
  // 2 (n-1)/n x 4 MiB, so completion is held at least that long after the last arrival.
  const LinkModel links = LinkModel::accelerator({.latency = 50'000, .bytes_per_second = 1e9});
  const MachineModel model({0, 0, 0, 0, 0, 0, 0, 0}, 1e12, links);
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(4);
  std::vector<std::vector<float>> bufs(4, std::vector<float>(1 << 20, 1.f));
  rt::GraphBuilder b;
  const auto members = comm.all_reduce(b, g, spans<float>(bufs), ReduceOp::sum);
  const rt::Graph graph = b.build();
  const rt::Nanos modelled = model.duration(graph.tasks(), members[0]);
  EXPECT_GE(modelled, 50'000 + static_cast<rt::Nanos>(1.5 * 4 * (1 << 20)));
  Machine machine(2);
  const rt::RunResult wall = machine.run(graph, {.link_model = &model});
  EXPECT_GE(wall.wall_time, modelled);
  EXPECT_EQ(bufs[3][12345], 4.f);
  // The same graph on the virtual clock, work executed: exactly the modelled time.
  rt::VirtualClock clock(model, {.execute = true});
  const rt::VirtualRunResult replay = clock.run(graph);
  EXPECT_EQ(replay.makespan, modelled);
  EXPECT_EQ(bufs[0][0], 16.f);
}

TEST(Collectives, BadInputsAreRefusedWithTheRule) {
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(3);
  std::vector<std::vector<float>> three(3, std::vector<float>(4)), two(2, std::vector<float>(4));
  rt::GraphBuilder b;
  EXPECT_NE(error_of([&] {
              comm.all_reduce(b, g, spans<float>(two), ReduceOp::sum);
            }).find("got 2 buffers"),
            std::string::npos);
  three[2].resize(5);
  EXPECT_NE(error_of([&] {
              comm.all_reduce(b, g, spans<float>(three), ReduceOp::sum);
            }).find("rank 2 (device 2)"),
            std::string::npos);
  three[2].resize(4);
  EXPECT_NE(error_of([&] { comm.broadcast(b, g, spans<float>(three), 3); }).find("root rank 3"),
            std::string::npos);
  std::vector<std::vector<float>> in(3, std::vector<float>(2)), out(3, std::vector<float>(5));
  EXPECT_NE(error_of([&] {
              comm.all_gather(b, g, spans<const float>(in), spans<float>(out));
            }).find("where 6 are needed"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              comm.all_to_all(b, g, spans<const float>(out), spans<float>(out));
            }).find("all_to_all_v"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              ProcessGroup("dup", {0, 1, 0});
            }).find("device 0 twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { g.rank_of(7); }).find("device 7 is not in process group 'g'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { comm.send_recv(b, 1, in[0], 1, out[0]); }).find("to itself"),
            std::string::npos);
}

TEST(Collectives, RunTimeOverflowCancelsTheRunAndNamesTheTask) {
  Machine machine(2);
  SharedMemoryCommunicator comm;
  const ProcessGroup g = first_devices(2);
  std::vector<std::int64_t> s0{0, 4}, s1{0, 0}, r0, r1;
  std::vector<float> send0(8), send1(8), recv0(8), recv1(2);  // rank 1 can take 2 elements
  std::vector<VariableAllToAllBuffers> bufs{{send0, &s0, recv0, &r0}, {send1, &s1, recv1, &r1}};
  rt::GraphBuilder b;
  comm.all_to_all_v(b, g, bufs, 1, {.name = "dispatch"});
  try {
    machine.run(b);
    FAIL() << "expected the run to fail";
  } catch (const rt::TaskError& e) {
    EXPECT_EQ(e.task_name(), "dispatch[1]");
    EXPECT_NE(std::string(e.what()).find("receives 4 elements"), std::string::npos) << e.what();
  }
}

TEST(Collectives, DifferentOrdersOnDifferentDevicesAreACycle) {
  // Device 0 runs A before B (its comm stream's order); device 1 is made to run B before A.
  // Neither collective could ever gather all its members: build() refuses the graph.
  SharedMemoryCommunicator comm;
  std::vector<std::vector<float>> a(2, std::vector<float>(4)), c(2, std::vector<float>(4));
  rt::GraphBuilder b;
  const auto ta = comm.all_reduce(b, ProcessGroup("A", {0, 1}), spans<float>(a), ReduceOp::sum);
  const auto tb = comm.all_reduce(b, ProcessGroup("B", {0, 1}), spans<float>(c), ReduceOp::sum);
  b.precede(tb[1], ta[1]);
  EXPECT_THROW(b.build(), rt::GraphError);
}

}  // namespace
}  // namespace weave::devices
