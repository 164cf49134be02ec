// The virtual clock: exact durations in integer nanoseconds, stream and engine rules,
// rendezvous timing, overlap of communication with compute, and trace metrics on the result.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <vector>

#include "weave/runtime/error.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::rt {
namespace {

// 1 flop = 1 ns; a message costs 100 ns and a byte 1 ns (1 GB/s).
const UniformCostModel kModel(1e9, 100, 1e9);

TaskSpec compute(DeviceId d, double flops, std::string_view name, StreamId s = kComputeStream) {
  return {
      .device = d, .stream = s, .kind = TaskKind::compute, .name = name, .cost = {.flops = flops}};
}
TaskSpec comm(DeviceId d, double bytes, std::string_view name, std::uint32_t messages = 1) {
  return {.device = d,
          .stream = kCommStream,
          .kind = TaskKind::comm,
          .name = name,
          .cost = {.bytes = bytes, .messages = messages}};
}

struct Interval {
  Nanos start, end;
  bool operator==(const Interval&) const = default;
};
Interval at(const Trace& t, TaskId id) {
  const Span* s = t.find(id);
  EXPECT_NE(s, nullptr) << "task " << id << " has no span";
  return s ? Interval{s->start, s->end} : Interval{-1, -1};
}

TEST(VirtualClock, ChainOnOneStreamLastsTheSumOfItsTasks) {
  GraphBuilder b;
  const TaskId a = b.add(compute(0, 300, "a"));
  const TaskId c = b.add(compute(0, 500, "c"));
  const TaskId d = b.add(comm(0, 1000, "d", 2));  // 2 * 100 + 1000
  b.precede(c, d);
  VirtualClock clock(kModel);
  const VirtualRunResult r = clock.run(b.build());
  EXPECT_EQ(at(r.trace, a), (Interval{0, 300}));
  EXPECT_EQ(at(r.trace, c), (Interval{300, 800}));
  EXPECT_EQ(at(r.trace, d), (Interval{800, 2000}));
  EXPECT_EQ(r.makespan, 2000);
  EXPECT_EQ(r.trace.clock(), ClockKind::virtual_time);
}

TEST(VirtualClock, ComputeAndCommStreamsOfADeviceOverlap) {
  GraphBuilder b;
  const TaskId x = b.add(compute(0, 1000, "x"));
  const TaskId y = b.add(comm(0, 400, "y"));
  const VirtualRunResult r = VirtualClock(kModel).run(b.build());
  EXPECT_EQ(at(r.trace, x), (Interval{0, 1000}));
  EXPECT_EQ(at(r.trace, y), (Interval{0, 500}));
}

TEST(VirtualClock, OneComputeEnginePerDeviceSerialisesComputeStreams) {
  GraphBuilder b;
  const StreamId side = b.stream("side");
  const TaskId first = b.add(compute(0, 100, "first"));
  const TaskId late = b.add(compute(0, 300, "late", side));    // ready at 100
  const TaskId early = b.add(compute(0, 200, "early", side));  // second on "side"
  const TaskId other = b.add(compute(1, 50, "other", side));   // another device: free engine
  const TaskId low = b.add(compute(0, 10, "low", b.stream("third")));  // ready at 0, id > first
  b.precede(first, late);
  const Graph g = b.build();

  // Device 0's engine: at 0, "first" (id 0) and "low" (id 4) are ready and the lower id goes
  // first. When "first" ends at 100, "late" becomes ready, but "low" has waited since 0: the
  // earliest ready goes next. "early" follows "late" on its stream.
  const VirtualRunResult r = VirtualClock(kModel).run(g);
  EXPECT_EQ(at(r.trace, first), (Interval{0, 100}));
  EXPECT_EQ(at(r.trace, low), (Interval{100, 110}));
  EXPECT_EQ(at(r.trace, late), (Interval{110, 410}));
  EXPECT_EQ(at(r.trace, early), (Interval{410, 610}));
  EXPECT_EQ(at(r.trace, other), (Interval{0, 50}));

  // Without the shared engine, streams compute in parallel.
  const VirtualRunResult p = VirtualClock(kModel, {.one_compute_engine_per_device = false}).run(g);
  EXPECT_EQ(at(p.trace, low), (Interval{0, 10}));
  EXPECT_EQ(at(p.trace, late), (Interval{100, 400}));
  EXPECT_EQ(at(p.trace, early), (Interval{400, 600}));
}

TEST(VirtualClock, EdgesAndEventsDelayExactlyToThePredecessorsEnd) {
  GraphBuilder b;
  const EventId e = b.event("e");
  const TaskId p = b.add(compute(1, 700, "producer"));
  const TaskId c = b.add(comm(0, 0, "consumer", 1));  // 100 ns
  const TaskId q = b.add(compute(2, 50, "q"));
  b.signal(p, e, 1);
  b.wait(c, e, 1);
  b.precede(c, q);
  const VirtualRunResult r = VirtualClock(kModel).run(b.build());
  EXPECT_EQ(at(r.trace, c), (Interval{700, 800}));
  EXPECT_EQ(at(r.trace, q), (Interval{800, 850}));
}

TEST(VirtualClock, RendezvousMembersEndTogetherAfterTheLastArrival) {
  GraphBuilder b;
  std::vector<TaskId> members;
  std::vector<Nanos> arrivals = {0, 300, 1200};
  for (DeviceId d = 0; d < 3; ++d) {
    const TaskId before = b.add(compute(d, static_cast<double>(arrivals[d]), "before"));
    // Members cost 100 + 400 (device 2 moves twice as much: 100 + 800).
    const TaskId m = b.add(comm(d, d == 2 ? 800 : 400, "member"));
    b.precede(before, m);
    members.push_back(m);
  }
  b.rendezvous("all_to_all", members);
  const TaskId after = b.add(compute(0, 10, "after"));
  b.precede(members[0], after);
  const VirtualRunResult r = VirtualClock(kModel).run(b.build());
  for (DeviceId d = 0; d < 3; ++d) {
    // Each starts when it arrived and all end at 1200 + max(500, 900).
    EXPECT_EQ(at(r.trace, members[d]), (Interval{arrivals[d], 2100})) << "device " << d;
  }
  EXPECT_EQ(at(r.trace, after), (Interval{2100, 2110}));
}

// The Ampipe pattern on one device: chunk 0 computes, then its all-to-all runs on the comm
// stream while chunk 1 computes; chunk 1's all-to-all ends the step.
TEST(VirtualClock, ChunkedExchangeOverlapsTheNextChunksCompute) {
  GraphBuilder b;
  std::vector<TaskId> compute_of, exchange_of;
  for (int c = 0; c < 2; ++c) {
    const TaskId x = b.add(compute(0, 1000, fmt::format("attention{}", c)));
    const TaskId a = b.add(comm(0, 500, fmt::format("dispatch{}", c)));  // 600 ns
    b.precede(x, a);
    compute_of.push_back(x);
    exchange_of.push_back(a);
  }
  const VirtualRunResult r = VirtualClock(kModel).run(b.build());
  EXPECT_EQ(at(r.trace, compute_of[0]), (Interval{0, 1000}));
  EXPECT_EQ(at(r.trace, compute_of[1]), (Interval{1000, 2000}));
  EXPECT_EQ(at(r.trace, exchange_of[0]), (Interval{1000, 1600}));
  EXPECT_EQ(at(r.trace, exchange_of[1]), (Interval{2000, 2600}));

  const TraceMetrics m = measure(r.trace);
  ASSERT_EQ(m.devices.size(), 1u);
  const DeviceMetrics& d = m.devices[0];
  EXPECT_EQ(m.makespan, 2600);
  EXPECT_EQ(d.compute_busy, 2000);
  EXPECT_EQ(d.comm_busy, 1200);
  EXPECT_EQ(d.exposed_comm, 600);  // dispatch0 hidden under attention1; dispatch1 exposed
  EXPECT_EQ(d.busy, 2600);
  EXPECT_EQ(d.stream_busy[kComputeStream], 2000);
  EXPECT_EQ(d.stream_busy[kCommStream], 1200);
  EXPECT_DOUBLE_EQ(d.idle_fraction, 0.0);
  EXPECT_DOUBLE_EQ(m.exposed_comm_share(), 600.0 / 2600.0);
}

TEST(VirtualClock, ExecuteRunsEachTaskOnceInDependencyOrder) {
  GraphBuilder b;
  std::vector<int> order;
  std::vector<TaskId> ids;
  for (int i = 0; i < 6; ++i) {
    ids.push_back(
        b.add(compute(static_cast<DeviceId>(i % 3), 100.0 * (6 - i), fmt::format("t{}", i)),
              [&order, i](TaskContext& ctx) {
                EXPECT_TRUE(ctx.virtual_time());
                order.push_back(i);
              }));
  }
  b.precede(ids[5], ids[0]);  // t0 only after t5
  const Graph g = b.build();
  VirtualClock clock(kModel, {.execute = true});
  clock.run(g);
  ASSERT_EQ(order.size(), 6u);
  EXPECT_EQ(std::count(order.begin(), order.end(), 0), 1);
  const auto pos = [&](int i) { return std::find(order.begin(), order.end(), i) - order.begin(); };
  EXPECT_LT(pos(5), pos(0));

  order.clear();
  VirtualClock skip(kModel);  // execute = false
  skip.run(g);
  EXPECT_TRUE(order.empty());
}

TEST(VirtualClock, ExecuteReportsTheFailingTask) {
  GraphBuilder b;
  b.add(compute(0, 10, "fine"));
  b.add(compute(1, 10, "broken"), [](TaskContext&) { throw std::runtime_error("bad shape"); });
  VirtualClock clock(kModel, {.execute = true});
  try {
    clock.run(b.build());
    FAIL();
  } catch (const TaskError& e) {
    EXPECT_EQ(e.task_name(), "broken");
    EXPECT_NE(std::string(e.what()).find("bad shape"), std::string::npos);
  }
}

TEST(VirtualClock, ReplaysAreIdenticalAndTraceIsOptional) {
  GraphBuilder b;
  for (DeviceId d = 0; d < 4; ++d) {
    TaskId prev = kNoTask;
    for (int i = 0; i < 50; ++i) {
      const TaskId t = b.add(i % 3 ? compute(d, 10.0 + i, "c") : comm(d, 5.0 * i, "m"));
      if (prev != kNoTask && i % 7 == 0) b.precede(prev, t);
      prev = t;
    }
  }
  const Graph g = b.build();
  VirtualClock clock(kModel);
  const VirtualRunResult one = clock.run(g), two = clock.run(g);
  ASSERT_EQ(one.trace.spans().size(), g.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    EXPECT_EQ(one.trace.spans()[i].start, two.trace.spans()[i].start);
    EXPECT_EQ(one.trace.spans()[i].end, two.trace.spans()[i].end);
  }
  Nanos latest = 0;
  for (const Span& s : one.trace.spans())
    latest = std::max(latest, s.end);
  EXPECT_EQ(one.makespan, latest);
  const VirtualRunResult bare = VirtualClock(kModel, {.record_trace = false}).run(g);
  EXPECT_TRUE(bare.trace.empty());
  EXPECT_EQ(bare.makespan, one.makespan);
}

TEST(VirtualClock, HostTasksCostNothingAndCostsRoundToNanoseconds) {
  GraphBuilder b;
  const TaskId h =
      b.add({.kind = TaskKind::host, .name = "h", .cost = {.flops = 1e9, .bytes = 1e9}});
  const TaskId f = b.add(compute(1, 2.4, "f"));
  const VirtualRunResult r = VirtualClock(kModel).run(b.build());
  EXPECT_EQ(at(r.trace, h), (Interval{0, 0}));
  EXPECT_EQ(at(r.trace, f), (Interval{0, 2}));
}

}  // namespace
}  // namespace weave::rt
