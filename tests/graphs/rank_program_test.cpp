// The training step as the union of rank programs: a rank's program built alone is exactly that
// rank's part of the whole graph; costs come from shapes, not names; each process group has its
// own stream, so collectives of different groups overlap on one device.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

struct Case {
  const char* name;
  int experts;
  ParallelPlan plan;
  Recompute recompute = {};
};

const Case kCases[] = {
    {"tp2_sp_ep2_dp2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"cp2_dp2",
     0,
     {.context_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4}},
    {"pp2_interleaved_ep2_dp2",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .pipeline_parallel = 2,
      .virtual_pipeline = 2,
      .micro_batch_size = 1,
      .global_batch_size = 8}},
    {"pp2_zb_h1_tp2_sp",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .pipeline_parallel = 2,
      .pipeline_scheduler = "zb-h1",
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"ampipe2_tp2_sp_ep2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"ampipe2_cp2_ep2_pipe_experts",
     4,
     {.context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_separate_streams = true,
      .pipe_experts_multi_data = 2}},
    // Full recomputation: the recomputed forwards' tasks and collectives, and the working sets.
    {"pp2_interleaved_ep2_dp2_recompute_uniform",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .pipeline_parallel = 2,
      .virtual_pipeline = 2,
      .micro_batch_size = 1,
      .global_batch_size = 8},
     {.granularity = RecomputeGranularity::full,
      .method = RecomputeMethod::uniform,
      .num_layers = 1}},
    {"ampipe2_tp2_sp_ep2_recompute_block",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2},
     {.granularity = RecomputeGranularity::full,
      .method = RecomputeMethod::block,
      .num_layers = 2}},
    // Selective recomputation: the norms', the experts' activation's and the MoE layers'
    // recomputed tasks, their collectives and the working sets (with the MLP's).
    {"tp2_sp_ep2_dp2_recompute_selective",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4},
     {.granularity = RecomputeGranularity::selective,
      .modules = kRecomputeCoreAttention | kRecomputeMlp | kRecomputeLayerNorm |
                 kRecomputeMoeActivation | kRecomputeMoe}},
    {"ampipe2_tp2_sp_ep2_recompute_moe_act",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2},
     {.granularity = RecomputeGranularity::selective,
      .modules = kRecomputeMlp | kRecomputeMoeActivation}},
    {"cp2_dp2_recompute_uniform2",
     0,
     {.context_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4},
     {.granularity = RecomputeGranularity::full,
      .method = RecomputeMethod::uniform,
      .num_layers = 2}},
};

ModelConfig model_of(const Case& c) {
  ModelConfig m = tiny(c.experts);
  m.num_layers = 4;  // two chunks per rank under interleaving
  m.recompute = c.recompute;
  return m;
}

// One task as the comparison sees it: what it is and what it costs, named by its place in its
// stream (names repeat across micro-batches).
using TaskKey = std::pair<std::string, int>;  // stream, index in the stream on its device
struct TaskView {
  std::string name;
  rt::TaskKind kind;
  double flops, bytes;
  std::uint32_t messages;
  int layer, micro_batch, virtual_stage;
  rt::Phase phase;
  bool operator==(const TaskView&) const = default;
};

struct DeviceView {
  std::map<TaskKey, TaskView> tasks;
  std::set<std::pair<TaskKey, TaskKey>> edges;  // explicit edges between this device's tasks
};

DeviceView view_of(const rt::Graph& g, rt::DeviceId device) {
  DeviceView v;
  std::map<rt::TaskId, TaskKey> key;
  std::map<std::string, int> next;
  for (rt::TaskId t = 0; t < g.size(); ++t) {
    const rt::TaskInfo& info = g.tasks()[t];
    if (info.device != device) continue;
    const std::string stream(g.tasks().stream_name(info.stream));
    key[t] = {stream, next[stream]++};
    v.tasks[key[t]] = {std::string(g.tasks().name(t)),
                       info.kind,
                       info.cost.flops,
                       info.cost.bytes,
                       info.cost.messages,
                       info.tags.layer,
                       info.tags.micro_batch,
                       info.tags.virtual_stage,
                       info.tags.phase};
  }
  for (const auto& [t, k] : key) {
    const auto succ = g.successors(t);
    const auto kinds = g.successor_kinds(t);
    for (std::size_t i = 0; i < succ.size(); ++i)
      if (kinds[i] == rt::EdgeKind::explicit_dependency && key.count(succ[i]))
        v.edges.insert({k, key.at(succ[i])});
  }
  return v;
}

class RankProgramAlone : public ::testing::TestWithParam<Case> {};

TEST_P(RankProgramAlone, EqualsItsPartOfTheWholeGraph) {
  const Case c = GetParam();
  const ModelConfig m = model_of(c);
  ParallelPlan plan = c.plan;
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep whole(m, plan, {}, set, comm);
  for (int r = 0; r < plan.devices(); ++r) {
    devices::DeviceSet own(plan.devices(), {.pin = false});
    const TrainingStep alone(m, plan, {}, own, comm, {.ranks = {r}});
    EXPECT_TRUE(alone.holds(r));
    EXPECT_FALSE(alone.holds((r + 1) % plan.devices()));
    const DeviceView want = view_of(whole.graph(), static_cast<rt::DeviceId>(r));
    const DeviceView got = view_of(alone.graph(), static_cast<rt::DeviceId>(r));
    ASSERT_FALSE(want.tasks.empty());
    // Nothing of another rank is built.
    std::size_t on_r = 0;
    for (rt::TaskId t = 0; t < alone.graph().size(); ++t)
      on_r += alone.graph().tasks()[t].device == static_cast<rt::DeviceId>(r);
    EXPECT_EQ(on_r, alone.graph().size()) << "rank " << r;
    ASSERT_EQ(got.tasks.size(), want.tasks.size()) << "rank " << r;
    for (const auto& [k, task] : want.tasks) {
      ASSERT_TRUE(got.tasks.count(k)) << "rank " << r << ": " << k.first << " #" << k.second;
      EXPECT_EQ(got.tasks.at(k), task)
          << "rank " << r << ": " << k.first << " #" << k.second << " " << task.name;
    }
    EXPECT_EQ(got.edges, want.edges) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Plans, RankProgramAlone, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// A copy of `g` whose tasks have other names (edges, streams, costs, work and rendezvous kept).
rt::Graph renamed(const rt::Graph& g) {
  rt::GraphBuilder b;
  const rt::TaskTable& tasks = g.tasks();
  for (rt::TaskId t = 0; t < g.size(); ++t) {
    const rt::TaskInfo& info = tasks[t];
    const std::string name = "task" + std::to_string(g.size() - t);
    b.add({.device = info.device,
           .stream = b.stream(tasks.stream_name(info.stream)),
           .kind = info.kind,
           .name = name,
           .tags = info.tags,
           .cost = info.cost},
          g.work(t));
  }
  for (rt::TaskId t = 0; t < g.size(); ++t) {
    const auto succ = g.successors(t);
    const auto kinds = g.successor_kinds(t);
    for (std::size_t i = 0; i < succ.size(); ++i)
      if (kinds[i] != rt::EdgeKind::stream_order) b.precede(t, succ[i]);
  }
  for (rt::GroupId grp = 0; grp < tasks.group_count(); ++grp)
    b.rendezvous("group" + std::to_string(grp), tasks.members(grp));
  return b.build();
}

TEST(CostsFromShapes, RenamedTasksReplayTheSame) {
  for (const Case& c : kCases) {
    const ModelConfig m = model_of(c);
    ParallelPlan plan = c.plan;
    validate(m, plan);
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    const TrainingStep step(m, plan, {}, set, comm);
    const devices::MachineModel machine(std::vector<int>(set.size(), 0), 1e12,
                                        devices::LinkModel::preset("ampipe-20gbps"));
    rt::VirtualClock clock(machine, {.execute = false});
    const rt::VirtualRunResult a = clock.run(step.graph());
    const rt::Graph other = renamed(step.graph());
    ASSERT_NE(other.tasks().name(0), step.graph().tasks().name(0));
    const rt::VirtualRunResult b = clock.run(other);
    EXPECT_EQ(a.makespan, b.makespan) << c.name;
    ASSERT_EQ(a.trace.spans().size(), b.trace.spans().size()) << c.name;
    for (std::size_t i = 0; i < a.trace.spans().size(); ++i) {
      EXPECT_EQ(a.trace.spans()[i].start, b.trace.spans()[i].start) << c.name << " task " << i;
      EXPECT_EQ(a.trace.spans()[i].end, b.trace.spans()[i].end) << c.name << " task " << i;
    }
    // And the costs are there to replay: the step's compute is priced.
    double flops = 0;
    for (rt::TaskId t = 0; t < step.graph().size(); ++t)
      flops += step.graph().tasks()[t].cost.flops;
    EXPECT_GT(flops, 0) << c.name;
  }
}

// Built without tensors, a step is the same graph (costs included) for the virtual clock, and its
// devices' trackers count what it would hold, while nothing is allocated.
TEST(StepWithoutTensors, ReplaysLikeTheStepWithTensorsAndAllocatesNothing) {
  for (const Case& c : kCases) {
    const ModelConfig m = model_of(c);
    ParallelPlan plan = c.plan;
    validate(m, plan);
    devices::SharedMemoryCommunicator comm;
    devices::DeviceSet with(plan.devices(), {.pin = false}),
        without(plan.devices(), {.pin = false});
    const TrainingStep real(m, plan, {}, with, comm);
    const TrainingStep shapes(m, plan, {}, without, comm, {.materialize = false});
    EXPECT_TRUE(real.materialized());
    EXPECT_FALSE(shapes.materialized());
    for (int d = 0; d < plan.devices(); ++d) {
      const auto id = static_cast<rt::DeviceId>(d);
      EXPECT_GT(with[id].allocated_bytes(), 0) << c.name;
      EXPECT_EQ(without[id].allocated_bytes(), 0) << c.name << " device " << d;
      for (auto category : {rt::MemoryCategory::parameters, rt::MemoryCategory::gradients,
                            rt::MemoryCategory::optimizer_state, rt::MemoryCategory::activations}) {
        EXPECT_GT(without.memory().current(id, category), 0)
            << c.name << " " << to_string(category);
        EXPECT_EQ(without.memory().current(id, category), with.memory().current(id, category))
            << c.name << " device " << d << " " << to_string(category);
      }
    }
    const devices::MachineModel machine(std::vector<int>(with.size(), 0), 1e12,
                                        devices::LinkModel::preset("ampipe-20gbps"));
    rt::VirtualClock clock(machine, {.execute = false});
    const rt::VirtualRunResult a = clock.run(real.graph()), b = clock.run(shapes.graph());
    EXPECT_EQ(a.makespan, b.makespan) << c.name;
    ASSERT_EQ(a.trace.spans().size(), b.trace.spans().size()) << c.name;
    for (std::size_t i = 0; i < a.trace.spans().size(); ++i) {
      EXPECT_EQ(a.trace.spans()[i].start, b.trace.spans()[i].start) << c.name << " task " << i;
      EXPECT_EQ(a.trace.spans()[i].end, b.trace.spans()[i].end) << c.name << " task " << i;
    }
  }
}

TEST(StepWithoutTensors, RefusesToRunOrReport) {
  const ModelConfig m = tiny(4);
  ParallelPlan plan{
      .expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2};
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const TrainingStep step(m, plan, {}, set, comm, {.materialize = false});
  try {
    set.executor().run(step.graph());
    ADD_FAILURE() << "expected the run to fail";
  } catch (const rt::TaskError& e) {
    EXPECT_PRED_FORMAT2(::testing::IsSubstring, "StepBuildOptions::materialize = false", e.what());
  }
  EXPECT_THROW(step.result(), std::logic_error);
}

TEST(RankProgramAlone, BadRankListsAndMissingRanksAreRefused) {
  const ModelConfig m = tiny(0);
  ParallelPlan plan{.data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2};
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  auto message = [&](const StepBuildOptions& options) {
    try {
      TrainingStep step(m, plan, {}, set, comm, options);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "names rank 2, outside the mesh of 2 ranks",
                      message({.ranks = {2}}));
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, "names rank 1 twice", message({.ranks = {1, 1}}));
  TrainingStep one(m, plan, {}, set, comm, {.ranks = {1}});
  EXPECT_THROW(one.shard(0), std::out_of_range);
  EXPECT_NO_THROW(one.shard(1));
}

// A stream per process group: with tp 2 + SP, ep 2 and Ampipe 2 on a slow link, a tensor-
// parallel collective of one chunk runs on device 0 while an expert all-to-all of the other
// chunk is in flight, each on its group's stream. One comm stream would queue them.
TEST(StreamPerGroup, TensorParallelCollectivesOverlapAnotherChunksAllToAll) {
  ModelConfig m = tiny(4);
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  m.hidden_size = 128;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 256;
  m.seq_length = 256;
  m.hidden_dropout = 0;
  ParallelPlan plan{.tensor_parallel = 2,
                    .sequence_parallel = true,
                    .expert_parallel = 2,
                    .micro_batch_size = 2,
                    .global_batch_size = 2,
                    .ampipe_degree = 2};
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  fill_batches(step, m, plan);
  step.prepare(1, 1e-3);
  // A link slow enough that a chunk's dispatch outlasts the next chunk's attention.
  const devices::MachineModel machine({0, 0}, 1e12, devices::LinkModel::preset("2:10"));
  rt::VirtualClock clock(machine, {.execute = true});
  const rt::Trace trace = clock.run(step.graph()).trace;
  auto span = [&](const char* name) {
    const rt::Span* s = trace.find(name);
    EXPECT_TRUE(s) << name;
    return s;
  };
  auto stream = [&](const rt::Span* s) {
    return std::string(trace.tasks().stream_name(trace.tasks()[s->task].stream));
  };
  auto overlap = [](const rt::Span* a, const rt::Span* b) {
    return a->start < b->end && b->start < a->end;
  };
  const rt::Span* dispatch = span("L0.c0.dispatch[0]");
  const rt::Span* reduce = span("L0.c1.attention_reduce[0]");
  const rt::Span* dispatch_back = span("L0.c0.dispatch_backward[0]");
  const rt::Span* gather_back = span("L0.c1.attention_grad_gather[0]");
  ASSERT_TRUE(dispatch && reduce && dispatch_back && gather_back);
  EXPECT_EQ(stream(dispatch), "ep");
  EXPECT_EQ(stream(reduce), "tp");
  // Forward: chunk 1's projection is reduce-scattered while chunk 0's tokens are dispatched.
  EXPECT_TRUE(overlap(dispatch, reduce))
      << "dispatch [" << dispatch->start << ", " << dispatch->end << "), reduce-scatter ["
      << reduce->start << ", " << reduce->end << ")";
  // Backward: chunk 1's gradient is gathered over tp while chunk 0's goes home over ep.
  EXPECT_TRUE(overlap(dispatch_back, gather_back))
      << "dispatch backward [" << dispatch_back->start << ", " << dispatch_back->end
      << "), gather [" << gather_back->start << ", " << gather_back->end << ")";
  // Each group's tasks keep to their stream: the trace shows one thread per group.
  std::set<std::string> streams;
  for (const rt::Span& s : trace.spans())
    if (trace.tasks()[s.task].device == 0) streams.insert(stream(&s));
  for (const char* expected : {"compute", "tp", "ep", "tp_cp", "world"})
    EXPECT_TRUE(streams.count(expected)) << expected;
  EXPECT_FALSE(streams.count("comm"));
}

}  // namespace
}  // namespace weave::graphs
