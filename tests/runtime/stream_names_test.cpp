// Streams named by the thousand (streams(prefix, count)) and anonymous streams, and task names
// kept once per run of equal names: what a trace, a DOT dump or a replay shows of a graph built
// this way is what it showed of the same graph built one name at a time.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "arenas.hpp"
#include "weave/runtime/chrome_trace.hpp"
#include "weave/runtime/cost_model.hpp"
#include "weave/runtime/dot_writer.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/graph.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::rt {
namespace {

TEST(StreamNames, NumberedStreamsHaveConsecutiveIdsAndAreFoundByName) {
  GraphBuilder b;
  const StreamId tp = b.stream("tp", 3);
  const StreamId first = b.streams("expert_", 4, 2);
  EXPECT_EQ(first, tp + 1);
  EXPECT_EQ(b.stream("expert_0"), first);
  EXPECT_EQ(b.stream("expert_3", 2), first + 3);
  EXPECT_THROW(b.stream("expert_2", 1), std::invalid_argument);  // a stream has one kind
  // Outside the range, or not the form the range writes: ordinary new names.
  const StreamId four = b.stream("expert_4");
  const StreamId padded = b.stream("expert_01");
  EXPECT_EQ(four, first + 4);
  EXPECT_EQ(padded, first + 5);
  b.add({.stream = static_cast<StreamId>(first + 2), .name = "e"});
  const Graph g = b.build();
  const TaskTable& t = g.tasks();
  ASSERT_EQ(t.stream_count(), 2u + 1 + 4 + 2);
  for (StreamId i = 0; i < 4; ++i) {
    EXPECT_EQ(t.stream_name(first + i), fmt::format("expert_{}", i));
    EXPECT_EQ(t.stream_kind(first + i), 2);
  }
  EXPECT_EQ(t.stream_name(tp), "tp");
  EXPECT_EQ(t.stream_name(four), "expert_4");
  EXPECT_EQ(t.stream_name(padded), "expert_01");
}

// The names are written by counting up decimal text in place: every carry (9 -> 10, 99 -> 100,
// 999 -> 1000), anonymous names from an id past 9, and a prefix longer than the block the names
// are copied in must read as fmt writes them.
TEST(StreamNames, NumberedNamesReadAsFormattedAcrossEveryCarry) {
  GraphBuilder b;
  const std::string long_prefix(40, 'p');
  const StreamId s = b.streams("s", 1'200);
  const StreamId anon = b.anonymous_streams(95);
  const StreamId longs = b.streams(long_prefix, 12);
  b.add({.stream = s, .name = "t"});
  const Graph g = b.build();
  const TaskTable& t = g.tasks();
  ASSERT_EQ(t.stream_count(), 2u + 1'200 + 95 + 12);
  for (StreamId i = 0; i < 1'200; ++i)
    ASSERT_EQ(t.stream_name(s + i), fmt::format("s{}", i));
  for (StreamId i = 0; i < 95; ++i)
    ASSERT_EQ(t.stream_name(anon + i), fmt::format("stream#{}", anon + i));
  for (StreamId i = 0; i < 12; ++i)
    ASSERT_EQ(t.stream_name(longs + i), fmt::format("{}{}", long_prefix, i));
}

TEST(StreamNames, RangesThatWouldShareNamesAreRefused) {
  GraphBuilder b;
  b.stream("s2");
  b.streams("c", 10);
  // "s2" exists, so "s" + 2 would be a second stream of that name.
  EXPECT_THROW(b.streams("s", 3), std::invalid_argument);
  EXPECT_NO_THROW(b.streams("s", 2));                       // s0, s1: no clash
  EXPECT_THROW(b.streams("c", 1), std::invalid_argument);   // one call per prefix
  EXPECT_THROW(b.streams("c1", 5), std::invalid_argument);  // "c1" + "0" reads as "c" + 10
  EXPECT_THROW(b.streams("x", 0), std::invalid_argument);
  EXPECT_THROW(b.streams("stream#", 2), std::invalid_argument);  // anonymous streams' form
  EXPECT_THROW(b.streams("y", 70'000), std::length_error);       // more than a graph holds
  try {
    b.streams("c1", 5);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ends in a digit"), std::string::npos) << e.what();
  }
}

TEST(StreamNames, AnonymousStreamsAreCalledByTheirIdInTracesAndDumps) {
  GraphBuilder b;
  const StreamId named = b.stream("tp");
  const StreamId a = b.anonymous_streams(2);
  const StreamId c = b.anonymous_streams();
  EXPECT_EQ(a, named + 1);
  EXPECT_EQ(c, a + 2);
  EXPECT_EQ(b.stream(fmt::format("stream#{}", a + 1)), a + 1);  // found by the name it shows
  const TaskId t0 = b.add({.stream = a, .name = "x", .cost = {.flops = 1e6}});
  const TaskId t1 = b.add({.stream = c, .name = "y", .cost = {.flops = 1e6}});
  b.precede(t0, t1);
  const Graph g = b.build();
  EXPECT_EQ(g.tasks().stream_name(a), "stream#3");
  EXPECT_EQ(g.tasks().stream_name(a + 1), "stream#4");
  EXPECT_EQ(g.tasks().stream_name(c), "stream#5");

  const UniformCostModel model(1e12, 0, 1e10);
  VirtualClock clock(model);
  std::ostringstream json;
  write_chrome_trace(clock.run(g).trace, json);
  EXPECT_NE(json.str().find("\"name\":\"stream#3\""), std::string::npos) << json.str();
  EXPECT_NE(json.str().find("\"name\":\"stream#5\""), std::string::npos) << json.str();
  // Read back, the trace's streams keep those names.
  std::istringstream in(json.str());
  const Trace read = read_chrome_trace(in);
  const Span* y = read.find("y");
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(read.tasks().stream_name(read.tasks()[y->task].stream), "stream#5");

  std::ostringstream dot;
  write_dot(g, dot);
  EXPECT_NE(dot.str().find("label=\"stream#3\""), std::string::npos) << dot.str();
}

// Tasks with one name in a row share its text, and every task still reads its own name.
TEST(StreamNames, TaskNamesResolveWhetherSharedOrNot) {
  GraphBuilder b;
  std::string reused = "fwd";
  const TaskId f0 = b.add({.name = reused});
  const TaskId f1 = b.add({.name = "fwd"});
  reused = "bwd";  // the builder keeps its own copy of a name
  const TaskId g0 = b.add({.name = reused});
  const TaskId unnamed = b.add({});
  const TaskId f2 = b.add({.name = "fwd"});
  const TaskId long_name = b.add({.name = "fwd_and_more"});
  const Graph g = b.build();
  EXPECT_EQ(g.tasks().name(f0), "fwd");
  EXPECT_EQ(g.tasks().name(f1), "fwd");
  EXPECT_EQ(g.tasks().name(g0), "bwd");
  EXPECT_EQ(g.tasks().name(unnamed), fmt::format("task{}", unnamed));
  EXPECT_EQ(g.tasks().name(f2), "fwd");
  EXPECT_EQ(g.tasks().name(long_name), "fwd_and_more");
}

// The benchmark's wavefront, large enough for its arrays to sit on huge pages: column j on
// stream "c<j>", (i, j) after (i, j - 1) explicitly and after (i - 1, j) by stream order.
Graph wavefront(int rows, int cols, bool numbered_streams, bool named_tasks) {
  GraphBuilder b;
  std::vector<StreamId> column(static_cast<std::size_t>(cols));
  if (numbered_streams) {
    const StreamId first = b.streams("c", static_cast<std::size_t>(cols));
    for (int j = 0; j < cols; ++j)
      column[j] = static_cast<StreamId>(first + j);
  } else {
    for (int j = 0; j < cols; ++j)
      column[j] = b.stream(fmt::format("c{}", j));
  }
  for (int i = 0; i < rows; ++i) {
    TaskId left = kNoTask;
    for (int j = 0; j < cols; ++j) {
      const std::string name = named_tasks ? fmt::format("w{}_{}", i, j) : std::string("w");
      const TaskId t = b.add({.device = static_cast<DeviceId>(j % 3),
                              .stream = column[j],
                              .name = name,
                              .cost = {.flops = 1e6 * (1 + (i + j) % 3)}});
      if (left != kNoTask) b.precede(left, t);
      left = t;
    }
  }
  return b.build();
}

TEST(StreamNames, AGraphOnNumberedStreamsIsTheGraphOnNamedOnes) {
  constexpr int kRows = 120, kCols = 100;  // 12,000 tasks: the task table passes 1 MiB
  const Graph old_api = wavefront(kRows, kCols, false, false);
  const Graph new_api = wavefront(kRows, kCols, true, false);
  ASSERT_EQ(old_api.size(), new_api.size());
  ASSERT_EQ(old_api.tasks().stream_count(), new_api.tasks().stream_count());
  for (StreamId s = 0; s < old_api.tasks().stream_count(); ++s)
    EXPECT_EQ(old_api.tasks().stream_name(s), new_api.tasks().stream_name(s));
  for (TaskId t = 0; t < old_api.size(); ++t) {
    ASSERT_EQ(old_api.tasks().name(t), new_api.tasks().name(t));
    ASSERT_EQ(old_api.tasks()[t].stream, new_api.tasks()[t].stream);
    const auto a = old_api.successors(t), b = new_api.successors(t);
    ASSERT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << t;
    const auto ka = old_api.successor_kinds(t), kb = new_api.successor_kinds(t);
    ASSERT_TRUE(std::equal(ka.begin(), ka.end(), kb.begin(), kb.end())) << t;
  }

  // Replayed on the virtual clock: the same spans, so the same trace file.
  const UniformCostModel model(1e11, 2'000, 20e9);
  VirtualClock clock(model);
  const VirtualRunResult ra = clock.run(old_api), rb = clock.run(new_api);
  EXPECT_EQ(ra.makespan, rb.makespan);
  // Independently: the last task's row and column each add one task of the cycle 1, 2, 3 MFLOP
  // at 1e11 FLOP/s; the critical path is at least the longest column's compute.
  EXPECT_GE(ra.makespan, kRows * 10'000);
  std::ostringstream ja, jb;
  write_chrome_trace(ra.trace, ja);
  write_chrome_trace(rb.trace, jb);
  EXPECT_EQ(ja.str(), jb.str());
  std::ostringstream da, db;
  write_dot(old_api, da);
  write_dot(new_api, db);
  EXPECT_EQ(da.str(), db.str());

  // And run by the executor: every task once, in an order the edges allow.
  testing::Arenas arenas(3);
  Executor executor(arenas.pointers());
  const Trace ran = executor.run(new_api, {.record_trace = true}).trace;
  ASSERT_EQ(ran.spans().size(), new_api.size());
  for (TaskId t = 0; t < new_api.size(); ++t) {
    for (TaskId s : new_api.successors(t))
      ASSERT_LE(ran.find(t)->end, ran.find(s)->start) << t << " -> " << s;
  }
}

// Task names given one per task (the training step's way) read back the same as shared ones.
TEST(StreamNames, DistinctTaskNamesAreKeptPerTask) {
  const Graph g = wavefront(4, 5, true, true);
  EXPECT_EQ(g.tasks().name(0), "w0_0");
  EXPECT_EQ(g.tasks().name(7), "w1_2");
  EXPECT_EQ(g.tasks().name(19), "w3_4");
}

// Without backward edges the order tasks were added in is a topological order; an edge to an
// earlier task sends build() through the full search, which still finds a cycle.
TEST(StreamNames, BackwardEdgesAreStillCheckedForCycles) {
  GraphBuilder ok;
  const TaskId a = ok.add({.name = "a"});
  const TaskId c = ok.add({.stream = kCommStream, .name = "c"});
  ok.precede(c, a);  // backward, acyclic
  const Graph g = ok.build();
  EXPECT_EQ(g.sources().size(), 1u);
  EXPECT_EQ(g.sources()[0], c);

  GraphBuilder bad;
  const TaskId x = bad.add({.name = "x"});
  const TaskId y = bad.add({.name = "y"});  // after x by stream order
  bad.precede(y, x);
  EXPECT_THROW(bad.build(), std::exception);
}

}  // namespace
}  // namespace weave::rt
