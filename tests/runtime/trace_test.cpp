// Chrome trace JSON, trace metrics on hand-made spans, and the DOT writer.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "arenas.hpp"
#include "weave/runtime/chrome_trace.hpp"
#include "weave/runtime/dot_writer.hpp"
#include "weave/runtime/executor.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::rt {
namespace {

Graph tagged_graph() {
  GraphBuilder b;
  const StreamId experts = b.stream("experts");
  const TaskId f =
      b.add({.device = 0,
             .name = "layer3 \"attn\"\\fwd\nchunk",
             .tags = {.layer = 3, .micro_batch = 1, .chunk = 0, .phase = Phase::forward},
             .cost = {.flops = 2000}});
  const TaskId a = b.add({.device = 1,
                          .stream = kCommStream,
                          .kind = TaskKind::comm,
                          .name = "all_to_all",
                          .tags = {.layer = 3, .virtual_stage = 1},
                          .cost = {.bytes = 4096}});
  const TaskId a0 = b.add({.device = 0,
                           .stream = kCommStream,
                           .kind = TaskKind::comm,
                           .name = "all_to_all",
                           .cost = {.bytes = 4096}});
  const TaskId w =
      b.add({.device = 2, .stream = experts, .name = "wgrad", .tags = {.phase = Phase::weight}});
  const TaskId bwd = b.add({.device = 2, .name = "bwd", .tags = {.phase = Phase::backward}});
  b.precede(f, a0);
  const TaskId pair[] = {a0, a};
  b.rendezvous("dispatch", pair);
  b.precede(a, w);
  b.precede(w, bwd);
  return b.build();
}

void check_chrome_trace(const Trace& trace) {
  std::ostringstream out;
  write_chrome_trace(trace, out);
  const auto j = nlohmann::json::parse(out.str());
  ASSERT_TRUE(j["traceEvents"].is_array());
  std::set<int> process_names;
  std::set<std::pair<int, int>> thread_names;
  std::map<std::string, nlohmann::json> slices;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") {
      process_names.insert(e["pid"].get<int>());
      EXPECT_EQ(e["args"]["name"], fmt::format("device {}", e["pid"].get<int>()));
    } else if (e["ph"] == "M" && e["name"] == "thread_name") {
      thread_names.emplace(e["pid"].get<int>(), e["tid"].get<int>());
    } else if (e["ph"] == "X") {
      EXPECT_TRUE(e["ts"].is_number());
      EXPECT_GE(e["dur"].get<double>(), 0.0);
      slices[fmt::format("{}@{}", e["name"].get<std::string>(), e["pid"].get<int>())] = e;
    }
  }
  EXPECT_EQ(process_names, (std::set<int>{0, 1, 2}));
  EXPECT_TRUE(thread_names.count({2, 2}));  // the "experts" stream on device 2
  ASSERT_EQ(slices.size(), 5u);
  const auto& f = slices.at("layer3 \"attn\"\\fwd\nchunk@0");  // escaping survived
  EXPECT_EQ(f["cat"], "compute");
  EXPECT_EQ(f["tid"], 0);
  EXPECT_EQ(f["args"]["layer"], 3);
  EXPECT_EQ(f["args"]["micro_batch"], 1);
  EXPECT_EQ(f["args"]["chunk"], 0);
  EXPECT_EQ(f["args"]["phase"], "F");
  EXPECT_EQ(f["args"]["flops"], 2000);
  EXPECT_FALSE(f["args"].contains("virtual_stage"));  // unset tags are left out
  const auto& a = slices.at("all_to_all@1");
  EXPECT_EQ(a["cat"], "comm");
  EXPECT_EQ(a["tid"], 1);
  EXPECT_EQ(a["args"]["virtual_stage"], 1);
  EXPECT_EQ(a["args"]["bytes"], 4096);
  EXPECT_EQ(a["args"]["rendezvous"], "dispatch");
  EXPECT_EQ(slices.at("wgrad@2")["args"]["phase"], "W");
  EXPECT_EQ(slices.at("bwd@2")["args"]["phase"], "B");
  EXPECT_EQ(j["otherData"]["tasks"], 5);
}

TEST(ChromeTrace, WallClockRunHasEveryFieldPerfettoNeeds) {
  testing::Arenas arenas(3);
  Executor executor(arenas.pointers());
  check_chrome_trace(executor.run(tagged_graph(), {.record_trace = true}).trace);
}

TEST(ChromeTrace, VirtualClockRunWritesTheSameFormat) {
  const UniformCostModel model(1e9, 10, 1e9);
  const VirtualRunResult r = VirtualClock(model).run(tagged_graph());
  check_chrome_trace(r.trace);
  std::ostringstream out;
  write_chrome_trace(r.trace, out);
  const auto j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["otherData"]["clock"], "virtual");
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["name"] == "bwd") {
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 0.0);
    } else if (e["name"] == "layer3 \"attn\"\\fwd\nchunk") {
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 2.0);  // 2000 ns in microseconds
    }
  }
}

// A trace written and read back keeps every span, name, stream, kind, tag and cost, and the
// metrics measured on it.
TEST(ChromeTrace, ReadBackGivesTheSameSpansAndMetrics) {
  const UniformCostModel model(1e9, 10, 1e9);
  const Trace written = VirtualClock(model).run(tagged_graph()).trace;
  std::stringstream file;
  write_chrome_trace(written, file);
  const Trace read = read_chrome_trace(file, "test trace");
  EXPECT_EQ(read.clock(), ClockKind::virtual_time);
  ASSERT_EQ(read.spans().size(), written.spans().size());
  for (std::size_t i = 0; i < read.spans().size(); ++i) {
    const Span& a = written.spans()[i];
    const Span& b = read.spans()[i];
    EXPECT_EQ(b.start, a.start);
    EXPECT_EQ(b.end, a.end);
    const TaskInfo& x = written.tasks()[a.task];
    const TaskInfo& y = read.tasks()[b.task];
    EXPECT_EQ(read.tasks().name(b.task), written.tasks().name(a.task));
    EXPECT_EQ(read.tasks().stream_name(y.stream), written.tasks().stream_name(x.stream));
    EXPECT_EQ(y.device, x.device);
    EXPECT_EQ(y.kind, x.kind);
    EXPECT_EQ(y.tags.layer, x.tags.layer);
    EXPECT_EQ(y.tags.micro_batch, x.tags.micro_batch);
    EXPECT_EQ(y.tags.virtual_stage, x.tags.virtual_stage);
    EXPECT_EQ(y.tags.phase, x.tags.phase);
    EXPECT_EQ(y.cost.flops, x.cost.flops);
    EXPECT_EQ(y.cost.bytes, x.cost.bytes);
  }
  const TraceMetrics m = measure(written), n = measure(read);
  EXPECT_EQ(n.makespan, m.makespan);
  EXPECT_EQ(n.total_exposed_comm(), m.total_exposed_comm());
  EXPECT_EQ(n.total_compute(), m.total_compute());
}

TEST(ChromeTrace, UnreadableTracesAreRefusedNamingTheProblem) {
  auto error = [](const std::string& text) {
    std::istringstream in(text);
    try {
      read_chrome_trace(in, "t.json");
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "t.json is not JSON", error("{\"traceEvents\": ["));
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "holds no trace events", error("{\"a\": 1}"));
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "event 0 (\"X\") has no numeric \"ts\"",
                      error(R"([{"ph": "X", "pid": 0, "tid": 0, "dur": 1}])"));
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "has pid -1",
                      error(R"([{"ph": "X", "pid": -1, "tid": 0, "ts": 0, "dur": 1}])"));
  EXPECT_THROW(read_chrome_trace("/nonexistent/trace.json"), std::runtime_error);
  // Another writer's events: compute tasks on a stream named after their thread.
  std::istringstream other(
      R"([{"ph": "X", "name": "k", "pid": 3, "tid": 7, "ts": 1.5, "dur": 2}])");
  const Trace t = read_chrome_trace(other, "other");
  ASSERT_EQ(t.spans().size(), 1u);
  EXPECT_EQ(t.tasks()[t.spans()[0].task].device, 3u);
  EXPECT_EQ(t.tasks().stream_name(t.tasks()[t.spans()[0].task].stream), "tid7");
  EXPECT_EQ(t.spans()[0].start, 1500);
  EXPECT_EQ(t.spans()[0].end, 3500);
}

TEST(ChromeTrace, FileIsWrittenWholeOrNotAtAll) {
  const UniformCostModel model(1e9, 10, 1e9);
  const Trace trace = VirtualClock(model).run(tagged_graph()).trace;
  const auto dir =
      std::filesystem::temp_directory_path() / fmt::format("weave-trace-{}", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "step.json").string();
  write_chrome_trace(trace, path);
  std::ifstream in(path);
  EXPECT_NO_THROW(nlohmann::json::parse(in));
  EXPECT_FALSE(std::filesystem::exists(path + ".partial"));
  const std::string bad = (dir / "missing" / "step.json").string();
  try {
    write_chrome_trace(trace, bad);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(ChromeTrace, EmptyTraceIsValidJson) {
  std::ostringstream out;
  write_chrome_trace(Trace(), out);
  EXPECT_TRUE(nlohmann::json::parse(out.str())["traceEvents"].empty());
}

// Spans placed by hand: device 0 computes [0,100) and [150,250), communicates [50,200) on
// comm and [220,300) on a copy stream; device 1 computes [0,40) only.
TEST(TraceMetrics, ExactFiguresFromHandMadeSpans) {
  auto table = std::make_shared<TaskTable>();
  const StreamId copy_stream = table->stream("copy");
  auto add = [&](DeviceId d, StreamId s, TaskKind k) {
    TaskInfo info;
    info.device = d;
    info.stream = s;
    info.kind = k;
    return table->add(info, "t");
  };
  const TaskId c1 = add(0, kComputeStream, TaskKind::compute);
  const TaskId c2 = add(0, kComputeStream, TaskKind::compute);
  const TaskId m1 = add(0, kCommStream, TaskKind::comm);
  const TaskId m2 = add(0, copy_stream, TaskKind::copy);
  const TaskId e1 = add(1, kComputeStream, TaskKind::compute);
  const Trace trace(table,
                    {{c1, 0, 100}, {c2, 150, 250}, {m1, 50, 200}, {m2, 220, 300}, {e1, 0, 40}},
                    ClockKind::virtual_time);
  const TraceMetrics m = measure(trace);
  EXPECT_EQ(m.start, 0);
  EXPECT_EQ(m.makespan, 300);
  ASSERT_EQ(m.devices.size(), 2u);
  const DeviceMetrics& d0 = m.devices[0];
  EXPECT_EQ(d0.compute_busy, 200);
  EXPECT_EQ(d0.comm_busy, 150 + 80);
  // Communication not covered by compute: [100,150) and [250,300).
  EXPECT_EQ(d0.exposed_comm, 100);
  EXPECT_EQ(d0.busy, 300);
  EXPECT_EQ(d0.stream_busy[kComputeStream], 200);
  EXPECT_EQ(d0.stream_busy[kCommStream], 150);
  EXPECT_EQ(d0.stream_busy[copy_stream], 80);
  EXPECT_DOUBLE_EQ(d0.idle_fraction, 0.0);
  const DeviceMetrics& d1 = m.devices[1];
  EXPECT_EQ(d1.busy, 40);
  EXPECT_EQ(d1.exposed_comm, 0);
  EXPECT_DOUBLE_EQ(d1.idle_fraction, 1.0 - 40.0 / 300.0);
  EXPECT_EQ(m.total_compute(), 240);
  EXPECT_EQ(m.total_comm(), 230);
  EXPECT_EQ(m.total_exposed_comm(), 100);
  EXPECT_DOUBLE_EQ(m.exposed_comm_share(), 100.0 / 340.0);
}

TEST(TraceMetrics, ExposedTimeOfNamedCommunication) {
  // Device 0 computes [0,100); its dispatch runs [50,150), a gradient all-reduce [120,200) and a
  // compute task named like an all-to-all [160,170). Device 1's combine [0,30) is all exposed.
  auto table = std::make_shared<TaskTable>();
  auto add = [&](DeviceId d, StreamId s, TaskKind k, const char* name) {
    TaskInfo info;
    info.device = d;
    info.stream = s;
    info.kind = k;
    return table->add(info, name);
  };
  const TaskId c = add(0, kComputeStream, TaskKind::compute, "attention");
  const TaskId a2a = add(0, kCommStream, TaskKind::comm, "L0.c0.dispatch[0]");
  const TaskId grad = add(0, kCommStream, TaskKind::comm, "layers.0.attention/dense.dp[0]");
  const TaskId local = add(0, kComputeStream, TaskKind::compute, "L0.c0.combine");
  const TaskId back = add(1, kCommStream, TaskKind::comm, "L0.c0.combine[1]");
  const Trace trace(
      table, {{c, 0, 100}, {a2a, 50, 150}, {grad, 120, 200}, {local, 160, 170}, {back, 0, 30}},
      ClockKind::virtual_time);
  constexpr std::string_view kAllToAll[] = {"dispatch", "combine"};
  EXPECT_EQ(exposed_comm_named(trace, kAllToAll), 50 + 30);
  constexpr std::string_view kGradients[] = {"dense.dp"};
  EXPECT_EQ(exposed_comm_named(trace, kGradients), 80 - 10);
}

TEST(TraceMetrics, ExposedTimeOfAStreamsCommunication) {
  // Device 0 computes [0,100); its tp collective runs [50,150), its tp_grad one [160,170) and an
  // ep all-to-all [90,130). The "tp" prefix takes both tp streams, "ep" the all-to-all.
  auto table = std::make_shared<TaskTable>();
  auto add = [&](const char* stream, TaskKind k) {
    TaskInfo info;
    info.stream = table->stream(stream);
    info.kind = k;
    return table->add(info, "t");
  };
  const TaskId c = add("compute", TaskKind::compute);
  const TaskId tp = add("tp", TaskKind::comm);
  const TaskId grad = add("tp_grad", TaskKind::comm);
  const TaskId ep = add("ep", TaskKind::comm);
  const Trace trace(table, {{c, 0, 100}, {tp, 50, 150}, {grad, 160, 170}, {ep, 90, 130}},
                    ClockKind::virtual_time);
  constexpr std::string_view kTensor[] = {"tp"};
  EXPECT_EQ(exposed_comm_on_streams(trace, kTensor), 50 + 10);
  constexpr std::string_view kExpert[] = {"ep"};
  EXPECT_EQ(exposed_comm_on_streams(trace, kExpert), 30);
}

// The streams of one process group found by the kind they were made with, or by their ids: the
// tensor group's two streams together, the expert group's apart.
TEST(TraceMetrics, ExposedTimeOfAStreamKindsCommunication) {
  // As above: device 0 computes [0,100); tp [50,150), tp_grad [160,170), ep [90,130).
  constexpr StreamKind kTensorKind = 1, kExpertKind = 4;
  auto table = std::make_shared<TaskTable>();
  auto add = [&](const char* stream, StreamKind kind, TaskKind k) {
    TaskInfo info;
    info.stream = table->stream(stream, kind);
    info.kind = k;
    return table->add(info, "t");
  };
  const TaskId c = add("compute", kUnclassifiedStream, TaskKind::compute);
  const TaskId tp = add("tp", kTensorKind, TaskKind::comm);
  const TaskId grad = add("tp_grad", kTensorKind, TaskKind::comm);
  const TaskId ep = add("ep", kExpertKind, TaskKind::comm);
  const Trace trace(table, {{c, 0, 100}, {tp, 50, 150}, {grad, 160, 170}, {ep, 90, 130}},
                    ClockKind::virtual_time);
  constexpr StreamKind kTensor[] = {kTensorKind};
  EXPECT_EQ(exposed_comm_on_stream_kinds(trace, kTensor), 50 + 10);
  constexpr StreamKind kExpert[] = {kExpertKind};
  EXPECT_EQ(exposed_comm_on_stream_kinds(trace, kExpert), 30);
  const StreamId tensor_streams[] = {table->stream("tp"), table->stream("tp_grad")};
  EXPECT_EQ(exposed_comm_on_stream_ids(trace, tensor_streams), 50 + 10);
  const StreamId expert_streams[] = {table->stream("ep")};
  EXPECT_EQ(exposed_comm_on_stream_ids(trace, expert_streams), 30);
  // Several sets in one pass, a stream in two of them: each set's figure as alone.
  const std::vector<StreamId> sets[] = {{table->stream("tp"), table->stream("tp_grad")},
                                        {table->stream("ep")},
                                        {table->stream("tp_grad"), table->stream("ep")},
                                        {}};
  EXPECT_EQ(exposed_comm_on_stream_sets(trace, sets),
            (std::vector<Nanos>{50 + 10, 30, 10 + 30, 0}));
}

// A kind keeps a group apart from another whose stream's name begins the same ("tp_cp").
TEST(TraceMetrics, ExposedTimeOfAKindIsItsStreamsOnly) {
  constexpr StreamKind kTensorKind = 1, kTensorContextKind = 6;
  auto table = std::make_shared<TaskTable>();
  auto add = [&](const char* stream, StreamKind kind, TaskKind k) {
    TaskInfo info;
    info.stream = table->stream(stream, kind);
    info.kind = k;
    return table->add(info, "t");
  };
  const TaskId c = add("compute", kUnclassifiedStream, TaskKind::compute);
  const TaskId tp = add("tp", kTensorKind, TaskKind::comm);
  const TaskId tp_cp = add("tp_cp", kTensorContextKind, TaskKind::comm);
  const Trace trace(table, {{c, 0, 100}, {tp, 90, 120}, {tp_cp, 200, 240}},
                    ClockKind::virtual_time);
  constexpr StreamKind kTensor[] = {kTensorKind};
  EXPECT_EQ(exposed_comm_on_stream_kinds(trace, kTensor), 20);
  constexpr StreamKind kBoth[] = {kTensorKind, kTensorContextKind};
  EXPECT_EQ(exposed_comm_on_stream_kinds(trace, kBoth), 20 + 40);
}

// Exact stream names keep a group apart from another whose name begins the same ("tp_cp").
TEST(TraceMetrics, ExposedTimeOfNamedStreams) {
  auto table = std::make_shared<TaskTable>();
  auto add = [&](const char* stream, TaskKind k) {
    TaskInfo info;
    info.stream = table->stream(stream);
    info.kind = k;
    return table->add(info, "t");
  };
  const TaskId c = add("compute", TaskKind::compute);
  const TaskId tp = add("tp", TaskKind::comm);
  const TaskId tp_cp = add("tp_cp", TaskKind::comm);
  const Trace trace(table, {{c, 0, 100}, {tp, 90, 120}, {tp_cp, 200, 240}},
                    ClockKind::virtual_time);
  constexpr std::string_view kTensor[] = {"tp"};
  EXPECT_EQ(exposed_comm_on_named_streams(trace, kTensor), 20);
  EXPECT_EQ(exposed_comm_on_streams(trace, kTensor), 20 + 40);  // the prefix takes tp_cp too
}

// A device with no task in the trace (held by another process, or folded into another) is not
// counted idle in the bubble.
TEST(TraceMetrics, BubbleCountsTheDevicesInTheTrace) {
  auto table = std::make_shared<TaskTable>();
  TaskInfo info;
  const TaskId a = table->add(info, "a");
  info.device = 2;
  const TaskId b = table->add(info, "b");
  const Trace trace(table, {{a, 0, 100}, {b, 50, 100}}, ClockKind::virtual_time);
  const TraceMetrics m = measure(trace);
  ASSERT_EQ(m.devices.size(), 3u);
  EXPECT_DOUBLE_EQ(m.compute_bubble(), 50.0 / 150.0);  // device 1 is not in it
}

TEST(TraceMetrics, MakespanStartsAtTheEarliestSpan) {
  auto table = std::make_shared<TaskTable>();
  TaskInfo info;
  const TaskId a = table->add(info, "a");
  const Trace trace(table, {{a, 1000, 1500}}, ClockKind::wall);
  const TraceMetrics m = measure(trace);
  EXPECT_EQ(m.start, 1000);
  EXPECT_EQ(m.makespan, 500);
  EXPECT_DOUBLE_EQ(m.devices[0].idle_fraction, 0.0);
}

TEST(Dot, GraphIsWellFormedAndShowsKindsStreamsEventsAndRendezvous) {
  GraphBuilder b;
  const EventId e = b.event("ready");
  const TaskId a = b.add({.device = 0, .name = "say \"hi\""});
  const TaskId a2 = b.add({.device = 0, .name = "a2"});  // stream order after a
  const TaskId s0 =
      b.add({.device = 0, .stream = kCommStream, .kind = TaskKind::comm, .name = "s0"});
  const TaskId s1 =
      b.add({.device = 1, .stream = kCommStream, .kind = TaskKind::comm, .name = "s1"});
  const TaskId h = b.add({.device = 1, .kind = TaskKind::host, .name = "h"});
  b.precede(a, s0);
  const TaskId pair[] = {s0, s1};
  b.rendezvous("p2p", pair);
  b.signal(s1, e, 1);
  b.wait(h, e, 1);
  (void)a2;
  std::ostringstream out;
  write_dot(b.build(), out);
  const std::string dot = out.str();

  EXPECT_EQ(dot.rfind("digraph", 0), 0u);
  EXPECT_EQ(std::count(dot.begin(), dot.end(), '{'), std::count(dot.begin(), dot.end(), '}'));
  std::set<std::string> declared;
  const std::regex node(R"(^\s+(t\d+) \[label=)");
  const std::regex edge(R"(^\s+(t\d+) -> (t\d+))");
  std::istringstream lines(dot);
  std::string line;
  std::vector<std::pair<std::string, std::string>> edges;
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, node)) declared.insert(m[1]);
    if (std::regex_search(line, m, edge)) edges.emplace_back(m[1], m[2]);
  }
  EXPECT_EQ(declared.size(), 5u);
  for (const auto& [from, to] : edges) {
    EXPECT_TRUE(declared.count(from)) << from;
    EXPECT_TRUE(declared.count(to)) << to;
  }
  EXPECT_NE(dot.find("cluster_d0"), std::string::npos);
  EXPECT_NE(dot.find("cluster_d1"), std::string::npos);
  EXPECT_NE(dot.find(fmt::format("t{} -> t{} [style=dashed", a, a2)), std::string::npos);
  EXPECT_NE(dot.find(fmt::format("t{} -> t{} [style=dotted", s1, h)), std::string::npos);
  EXPECT_NE(dot.find("peripheries=2"), std::string::npos);
  EXPECT_NE(dot.find("label=\"p2p\""), std::string::npos);
  EXPECT_NE(dot.find("say \\\"hi\\\""), std::string::npos);  // quotes escaped
}

}  // namespace
}  // namespace weave::rt
