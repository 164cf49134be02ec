// Eager mode: streams that run enqueued work in order, timeline events across streams and
// devices, host waits, and failures that propagate instead of hanging.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "arenas.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/event.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/stream.hpp"

namespace weave::rt {
namespace {

using testing::Arenas;
using testing::limit_threads;

class EagerThreads : public ::testing::TestWithParam<int> {};

TEST_P(EagerThreads, StreamRunsInOrderAndEventsOrderStreamsAcrossDevices) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(8);
  Executor executor(arenas.pointers());
  std::vector<int> order;
  Stream s = executor.stream(0);
  Stream same = executor.stream(0);  // the same stream: still one order
  for (int i = 0; i < 100; ++i)
    (i % 2 ? s : same).enqueue("push", [&order, i] { order.push_back(i); });
  s.synchronize();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i)
    EXPECT_EQ(order[i], i);

  // A chain of hand-offs through all 8 devices' comm streams.
  std::vector<int> values(8, 0);
  Event baton("baton");
  for (DeviceId d = 0; d < 8; ++d) {
    Stream c = executor.stream(d, kCommStream);
    if (d > 0) c.wait(baton, d);
    c.enqueue(
        "relay", [&values, d] { values[d] = d == 0 ? 1 : values[d - 1] + 1; }, TaskKind::comm);
    c.signal(baton, d + 1);
  }
  executor.wait(baton, 8);
  for (int d = 0; d < 8; ++d)
    EXPECT_EQ(values[d], d + 1);
  EXPECT_EQ(baton.value(), 8u);
}

TEST_P(EagerThreads, FailureDropsQueuedWorkFailsEventsAndReportsOnce) {
  auto limit = limit_threads(GetParam());
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  Stream producer = executor.stream(0);
  Stream consumer = executor.stream(1);
  Event ready("ready");
  bool dropped_ran = false, consumer_ran = false;
  producer.enqueue("bad-kernel", [] { throw std::runtime_error("shape (2, 3) vs (3, 3)"); });
  producer.enqueue("dropped", [&] { dropped_ran = true; });
  producer.signal(ready, 1);
  consumer.wait(ready, 1);
  consumer.enqueue("needs-ready", [&] { consumer_ran = true; });
  try {
    producer.synchronize();
    FAIL() << "synchronize should report the failed task";
  } catch (const TaskError& e) {
    EXPECT_EQ(e.task_name(), "bad-kernel");
    EXPECT_NE(std::string(e.what()).find("shape (2, 3)"), std::string::npos);
  }
  EXPECT_FALSE(dropped_ran);
  EXPECT_TRUE(ready.failed());
  try {
    consumer.synchronize();
    FAIL() << "the waiting stream should fail, not hang";
  } catch (const TaskError& e) {
    EXPECT_NE(std::string(e.what()).find("bad-kernel"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(consumer_ran);
  EXPECT_THROW(executor.wait(ready, 1), TaskError);
  // Reported once: the streams work again.
  int later = 0;
  producer.enqueue("later", [&] { later = 1; });
  producer.synchronize();
  consumer.synchronize();
  EXPECT_EQ(later, 1);
}

INSTANTIATE_TEST_SUITE_P(Threads, EagerThreads, ::testing::Values(1, 2, 4));

TEST(Eager, HostSignalMustGrowTheTimeline) {
  Event e("clock");
  e.signal(3);
  EXPECT_EQ(e.value(), 3u);
  try {
    e.signal(3);
    FAIL();
  } catch (const std::invalid_argument& err) {
    EXPECT_NE(std::string(err.what()).find("'clock'"), std::string::npos);
  }
  EXPECT_EQ(e.value(), 3u);
}

TEST(Eager, HostSignalReleasesAParkedStream) {
  auto limit = limit_threads(2);
  Arenas arenas(1);
  Executor executor(arenas.pointers());
  Event go("go");
  Stream s = executor.stream(0, "side");
  std::atomic<bool> ran{false};
  s.wait(go, 1);
  s.enqueue("after-go", [&] { ran = true; });
  EXPECT_FALSE(ran.load());
  go.signal(1);
  s.synchronize();
  EXPECT_TRUE(ran.load());
}

TEST(Eager, SynchronizeInsideATaskIsRefused) {
  Arenas arenas(1);
  Executor executor(arenas.pointers());
  Stream s = executor.stream(0);
  Stream other = executor.stream(0, kCommStream);
  s.enqueue("nested", [&] { other.synchronize(); });
  try {
    s.synchronize();
    FAIL();
  } catch (const TaskError& e) {
    EXPECT_EQ(e.task_name(), "nested");
    EXPECT_NE(std::string(e.what()).find("inside a task"), std::string::npos);
  }
}

TEST(Eager, BadDeviceOrStreamIsRefused) {
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  EXPECT_THROW(executor.stream(2), std::out_of_range);
  EXPECT_THROW(executor.stream(0, StreamId{9}), std::out_of_range);
  const Stream named = executor.stream(1, "experts");
  EXPECT_EQ(named.device(), 1u);
  EXPECT_EQ(executor.stream(0, "experts").id(), named.id());
}

TEST(Eager, TraceRecordsEachTaskOnItsStream) {
  Arenas arenas(2);
  Executor executor(arenas.pointers());
  executor.begin_eager_trace();
  Stream a = executor.stream(0);
  Stream b = executor.stream(1, "experts");
  a.enqueue("a0", [] {});
  a.enqueue("a1", [] {}, TaskKind::compute, {.layer = 2});
  b.enqueue(
      "b0", [] {}, TaskKind::comm);
  a.synchronize();
  b.synchronize();
  const Trace t = executor.end_eager_trace();
  ASSERT_EQ(t.spans().size(), 3u);
  const Span* b0 = t.find("b0");
  ASSERT_NE(b0, nullptr);
  EXPECT_EQ(t.tasks()[b0->task].device, 1u);
  EXPECT_EQ(t.tasks().stream_name(t.tasks()[b0->task].stream), "experts");
  EXPECT_EQ(t.tasks()[t.find("a1")->task].tags.layer, 2);
  EXPECT_LE(t.find("a0")->end, t.find("a1")->start);
}

}  // namespace
}  // namespace weave::rt
