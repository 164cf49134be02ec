// Graph building and validation: stream order, events, rendezvous, cycle refusal.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "weave/runtime/error.hpp"
#include "weave/runtime/graph.hpp"

namespace weave::rt {
namespace {

bool has_edge(const Graph& g, TaskId from, TaskId to, EdgeKind kind) {
  const auto succ = g.successors(from);
  const auto kinds = g.successor_kinds(from);
  for (std::size_t i = 0; i < succ.size(); ++i) {
    if (succ[i] == to && kinds[i] == kind) return true;
  }
  return false;
}

std::string build_error(GraphBuilder& b) {
  try {
    b.build();
  } catch (const GraphError& e) {
    return e.what();
  }
  return "";
}

TEST(Graph, TasksOnOneStreamAreChainedInOrderAdded) {
  GraphBuilder b;
  const TaskId a = b.add({.device = 0, .name = "a"});
  const TaskId c = b.add({.device = 0, .stream = kCommStream, .name = "c"});
  const TaskId x = b.add({.device = 0, .name = "x"});
  const TaskId y = b.add({.device = 1, .name = "y"});
  const Graph g = b.build();
  EXPECT_TRUE(has_edge(g, a, x, EdgeKind::stream_order));
  EXPECT_FALSE(has_edge(g, a, c, EdgeKind::stream_order));  // other stream: concurrent
  EXPECT_EQ(g.in_degree(y), 0u);                            // other device
  EXPECT_EQ(g.sources().size(), 3u);
  EXPECT_EQ(g.sink_count(), 3u);
  EXPECT_EQ(g.tasks().device_count(), 2u);
}

TEST(Graph, NamedStreamsAreSharedAcrossDevicesAndNamesKept) {
  GraphBuilder b;
  EXPECT_EQ(b.stream("compute"), kComputeStream);
  EXPECT_EQ(b.stream("comm"), kCommStream);
  const StreamId extra = b.stream("expert-1");
  EXPECT_EQ(b.stream("expert-1"), extra);
  const TaskId t = b.add({.device = 3, .stream = extra, .name = "e"});
  const TaskId u = b.add({.name = ""});
  const Graph g = b.build();
  EXPECT_EQ(g.tasks().stream_name(extra), "expert-1");
  EXPECT_EQ(g.tasks().name(t), "e");
  EXPECT_EQ(g.tasks().name(u), "task1");
}

// A stream carries the kind its maker gives it (a process group, for a training step), so
// reports group streams without reading their names.
TEST(Graph, AStreamKeepsTheKindItWasGiven) {
  GraphBuilder b;
  const StreamId tp = b.stream("tp", 1);
  const StreamId grad = b.stream("tp_grad", 1);
  const StreamId ep = b.stream("ep", 2);
  EXPECT_EQ(b.stream("tp"), tp);     // unclassified asks for the stream whatever its kind
  EXPECT_EQ(b.stream("tp", 1), tp);  // the same kind again
  EXPECT_THROW(b.stream("ep", 1), std::invalid_argument);  // a stream has one kind
  const StreamId later = b.stream("late");
  EXPECT_EQ(b.stream("late", 3), later);  // an unclassified stream takes the first kind given
  b.add({.stream = ep, .name = "x"});
  const Graph g = b.build();
  EXPECT_EQ(g.tasks().stream_kind(tp), 1);
  EXPECT_EQ(g.tasks().stream_kind(grad), 1);
  EXPECT_EQ(g.tasks().stream_kind(ep), 2);
  EXPECT_EQ(g.tasks().stream_kind(later), 3);
  EXPECT_EQ(g.tasks().stream_kind(kCommStream), kUnclassifiedStream);
}

TEST(Graph, TaskOnUnnamedStreamIsRefused) {
  GraphBuilder b;
  EXPECT_THROW(b.add({.stream = 7, .name = "bad"}), std::invalid_argument);
  EXPECT_EQ(b.size(), 0u);
}

TEST(Graph, EventWaitBecomesEdgeFromFirstSignalReachingTheValue) {
  GraphBuilder b;
  const EventId e = b.event("ready");
  const TaskId s1 = b.add({.device = 0, .name = "s1"});
  const TaskId s3 = b.add({.device = 0, .name = "s3"});
  const TaskId w2 = b.add({.device = 1, .name = "w2"});
  const TaskId w1 = b.add({.device = 2, .name = "w1"});
  b.signal(s1, e, 1);
  b.signal(s3, e, 3);
  b.wait(w2, e, 2);
  b.wait(w1, e, 1);
  const Graph g = b.build();
  EXPECT_TRUE(has_edge(g, s3, w2, EdgeKind::event));
  EXPECT_TRUE(has_edge(g, s1, w1, EdgeKind::event));
  EXPECT_FALSE(has_edge(g, s1, w2, EdgeKind::event));
}

TEST(Graph, WaitThatNoSignalReachesIsRefusedWithTheHighestSignal) {
  GraphBuilder b;
  const EventId e = b.event("grads");
  const TaskId s = b.add({.name = "producer"});
  const TaskId w = b.add({.device = 1, .name = "consumer"});
  b.signal(s, e, 2);
  b.wait(w, e, 5);
  const std::string msg = build_error(b);
  EXPECT_NE(msg.find("'consumer'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'grads'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("highest signal is 2 by 'producer'"), std::string::npos) << msg;
}

TEST(Graph, DuplicateSignalValueIsRefused) {
  GraphBuilder b;
  const EventId e = b.event("e");
  const TaskId a = b.add({.name = "a"});
  const TaskId c = b.add({.device = 1, .name = "c"});
  b.signal(a, e, 1);
  b.signal(c, e, 1);
  const std::string msg = build_error(b);
  EXPECT_NE(msg.find("signalled to 1 twice"), std::string::npos) << msg;
}

TEST(Graph, CycleIsRefusedNamingEveryTaskOnIt) {
  GraphBuilder b;
  const TaskId free = b.add({.device = 2, .name = "unrelated"});
  const TaskId a = b.add({.device = 0, .name = "alpha"});
  const TaskId c = b.add({.device = 1, .name = "beta"});
  const TaskId d = b.add({.device = 1, .stream = kCommStream, .name = "gamma"});
  b.precede(a, c);
  b.precede(c, d);
  b.precede(d, a);
  b.precede(free, a);
  const std::string msg = build_error(b);
  for (const char* name : {"'alpha'", "'beta'", "'gamma'"}) {
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
  }
  EXPECT_EQ(msg.find("'unrelated'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cycle of 3 nodes"), std::string::npos) << msg;
}

TEST(Graph, CycleThroughStreamOrderIsExplained) {
  GraphBuilder b;
  const TaskId first = b.add({.device = 0, .name = "first"});
  const TaskId second = b.add({.device = 0, .name = "second"});  // after first on the stream
  b.precede(second, first);
  const std::string msg = build_error(b);
  EXPECT_NE(msg.find("stream order"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'first'"), std::string::npos) << msg;
  (void)second;
}

TEST(Graph, FailedBuildLeavesBuilderUsable) {
  GraphBuilder b;
  const TaskId a = b.add({.name = "a"});
  const TaskId c = b.add({.device = 1, .name = "c"});
  const EventId e = b.event("e");
  b.wait(c, e, 1);  // never signalled
  EXPECT_THROW(b.build(), GraphError);
  b.signal(a, e, 1);
  const Graph g = b.build();
  EXPECT_EQ(g.size(), 2u);
  EXPECT_TRUE(has_edge(g, a, c, EdgeKind::event));
}

// Two collectives issued in opposite orders on two devices: each device's comm stream
// orders them, so merged rendezvous nodes form a cycle: the classic collective deadlock.
TEST(Graph, CollectivesIssuedInDifferentOrdersAreACycle) {
  GraphBuilder b;
  const TaskId x0 =
      b.add({.device = 0, .stream = kCommStream, .kind = TaskKind::comm, .name = "x@0"});
  const TaskId y0 =
      b.add({.device = 0, .stream = kCommStream, .kind = TaskKind::comm, .name = "y@0"});
  const TaskId y1 =
      b.add({.device = 1, .stream = kCommStream, .kind = TaskKind::comm, .name = "y@1"});
  const TaskId x1 =
      b.add({.device = 1, .stream = kCommStream, .kind = TaskKind::comm, .name = "x@1"});
  const TaskId xs[] = {x0, x1};
  const TaskId ys[] = {y0, y1};
  b.rendezvous("allreduce-x", xs);
  b.rendezvous("allreduce-y", ys);
  const std::string msg = build_error(b);
  EXPECT_NE(msg.find("rendezvous 'allreduce-x'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rendezvous 'allreduce-y'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("different orders"), std::string::npos) << msg;
}

TEST(Graph, SameOrderCollectivesBuild) {
  GraphBuilder b;
  TaskId x[2], y[2];
  for (DeviceId d = 0; d < 2; ++d) {
    x[d] = b.add({.device = d, .stream = kCommStream, .kind = TaskKind::comm, .name = "x"});
    y[d] = b.add({.device = d, .stream = kCommStream, .kind = TaskKind::comm, .name = "y"});
  }
  b.rendezvous("x", x);
  b.rendezvous("y", y);
  const Graph g = b.build();
  EXPECT_EQ(g.tasks().group_count(), 2u);
  EXPECT_EQ(g.tasks()[x[1]].group, 0u);
}

TEST(Graph, RendezvousRulesAreChecked) {
  GraphBuilder b;
  const TaskId a = b.add({.name = "a"});
  const TaskId c = b.add({.device = 1, .name = "c"});
  const TaskId twice[] = {a, a};
  EXPECT_THROW(b.rendezvous("dup", twice), std::invalid_argument);
  const TaskId missing[] = {a, 99};
  EXPECT_THROW(b.rendezvous("missing", missing), std::invalid_argument);
  EXPECT_THROW(b.rendezvous("empty", {}), std::invalid_argument);
  const TaskId pair[] = {a, c};
  b.rendezvous("ok", pair);
  const TaskId again[] = {c};
  try {
    b.rendezvous("again", again);
    FAIL() << "a task joined two rendezvous";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("already a member of rendezvous 'ok'"), std::string::npos);
  }
  b.precede(a, c);  // members cannot wait for each other
  EXPECT_THROW(b.build(), GraphError);
}

TEST(Graph, BadIdsAreRefused) {
  GraphBuilder b;
  const TaskId a = b.add({.name = "a"});
  EXPECT_THROW(b.precede(a, 5), std::invalid_argument);
  EXPECT_THROW(b.precede(a, a), std::invalid_argument);
  EXPECT_THROW(b.signal(a, 3, 1), std::invalid_argument);
}

TEST(Graph, BuildEmptiesTheBuilderAndGraphsShareData) {
  GraphBuilder b;
  b.add({.name = "a"});
  const Graph g = b.build();
  EXPECT_EQ(b.size(), 0u);
  const Graph copy = g;
  EXPECT_EQ(&copy.tasks(), &g.tasks());
  EXPECT_TRUE(Graph().empty());
}

}  // namespace
}  // namespace weave::rt
