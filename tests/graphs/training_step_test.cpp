// Parallel equals serial: the training step under tensor, sequence and data parallelism (dense
// and MoE) gives the one-device loss and gradients, and the same loss curve.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/machine_model.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {
namespace {

struct Case {
  const char* name;
  int experts;
  ParallelPlan plan;
};

class ParallelEqualsSerial : public ::testing::TestWithParam<Case> {};

TEST_P(ParallelEqualsSerial, LossAndGradients) {
  const Case c = GetParam();
  const ModelConfig m = tiny(c.experts);
  const ParallelPlan serial{.micro_batch_size = c.plan.micro_batch_size,
                            .global_batch_size = c.plan.global_batch_size};
  const Outcome a = run(m, serial, 1, false), b = run(m, c.plan, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * std::max(a.aux[0], 1e-3));
  expect_same_gradients(a, b);
}

TEST_P(ParallelEqualsSerial, LossCurve) {
  const Case c = GetParam();
  const ModelConfig m = tiny(c.experts);
  const ParallelPlan serial{.micro_batch_size = c.plan.micro_batch_size,
                            .global_batch_size = c.plan.global_batch_size};
  const Outcome a = run(m, serial, 10, true), b = run(m, c.plan, 10, true);
  for (std::size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_NEAR(b.losses[i], a.losses[i], 1e-4 * a.losses[i]) << "step " << i + 1;
  EXPECT_LT(a.losses.back(), a.losses.front());  // it learns
}

const Case kCases[] = {
    {"tp2", 0, {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"tp2_sp",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"tp4_sp",
     0,
     {.tensor_parallel = 4,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"dp2", 0, {.data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"tp2_sp_dp2",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
    {"moe_tp2", 4, {.tensor_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"moe_tp2_sp",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"moe_dp2", 4, {.data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"moe_dp2_ep2",
     4,
     {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"moe_tp2_sp_ep2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"moe_tp2_ep2",
     4,
     {.tensor_parallel = 2, .expert_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"cp2", 0, {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"cp2_tp2_sp",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"cp2_dp2",
     0,
     {.context_parallel = 2, .data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"cp4", 0, {.context_parallel = 4, .micro_batch_size = 2, .global_batch_size = 4}},
    {"moe_cp2", 4, {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}},
    {"moe_cp2_tp2_sp_ep2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"moe_tp2_sp_dp2_ep4",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 4,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4}},
};

INSTANTIATE_TEST_SUITE_P(Plans, ParallelEqualsSerial, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The whole model's gradient against a central difference of the loss along a random
// direction: catches a wrongly wired backward that parallel-equals-serial cannot (both sides
// would share it).
class WholeModelGradient : public ::testing::TestWithParam<int> {};

TEST_P(WholeModelGradient, MatchesADirectionalDifference) {
  ModelConfig m = tiny(GetParam());
  m.hidden_dropout = 0;
  ParallelPlan plan{.tensor_parallel = 2,
                    .sequence_parallel = true,
                    .micro_batch_size = 2,
                    .global_batch_size = 4};
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  step.set_update_parameters(false);
  for (int mb = 0; mb < plan.micro_batches(); ++mb) {
    MicroBatch& batch = step.micro_batch(0, mb);
    for (std::size_t i = 0; i < batch.tokens.size(); ++i) {
      batch.tokens[i] = token(mb, static_cast<std::int64_t>(i), m.vocab_size);
      batch.targets[i] = token(mb, static_cast<std::int64_t>(i) + 1, m.vocab_size);
    }
  }
  auto objective = [&] {
    set.executor().run(step.graph());
    return step.result().loss + step.result().aux_loss;
  };
  objective();
  // A random direction, the same on every replica of a value (keyed by logical position).
  std::map<std::string, std::vector<double>> direction;
  std::mt19937 gen(5);
  std::normal_distribution<double> normal;
  double along = 0;  // <gradient, direction>, each logical element once
  for (const Parameter& p : step.shard(0).parameters()) {
    auto& v = direction[p.name];
    v.resize(static_cast<std::size_t>(p.logical_rows * p.logical_cols));
    for (auto& x : v)
      x = normal(gen);
  }
  const Outcome grads = [&] {
    Outcome o;
    for (int r = 0; r < plan.devices(); ++r)
      for (const Parameter& p : step.shard(r).parameters()) {
        auto& g = o.grads[p.name];
        g.resize(static_cast<std::size_t>(p.logical_rows * p.logical_cols), 0.0);
        for (std::int64_t lr = 0; lr < local_rows(p); ++lr)
          for (std::int64_t lc = 0; lc < local_cols(p); ++lc)
            g[static_cast<std::size_t>(p.row_map[lr] * p.logical_cols + p.col_offset + lc)] =
                p.grad.data()[lr * local_cols(p) + lc];
      }
    return o;
  }();
  for (const auto& [name, g] : grads.grads)
    for (std::size_t i = 0; i < g.size(); ++i)
      along += g[i] * direction[name][i];
  auto shift = [&](double eps) {
    for (int r = 0; r < plan.devices(); ++r)
      for (Parameter& p : step.shard(r).parameters()) {
        const auto& v = direction[p.name];
        for (std::int64_t lr = 0; lr < local_rows(p); ++lr)
          for (std::int64_t lc = 0; lc < local_cols(p); ++lc)
            p.value.data()[lr * local_cols(p) + lc] += static_cast<float>(
                eps *
                v[static_cast<std::size_t>(p.row_map[lr] * p.logical_cols + p.col_offset + lc)]);
      }
  };
  // Small enough that no token changes its top-k experts (a discontinuity) along the way.
  const double eps = 1e-4;
  shift(eps);
  const double up = objective();
  shift(-2 * eps);
  const double down = objective();
  shift(eps);
  const double numeric = (up - down) / (2 * eps);
  EXPECT_NEAR(along, numeric, 2e-2 * std::abs(numeric))
      << "analytic " << along << ", numeric " << numeric;
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, WholeModelGradient, ::testing::Values(0, 4));

class DistributedOptimizer : public ::testing::TestWithParam<Case> {};

TEST_P(DistributedOptimizer, LossCurveEqualsSerial) {
  const Case c = GetParam();
  const ModelConfig m = tiny(c.experts);
  const ParallelPlan serial{.micro_batch_size = c.plan.micro_batch_size,
                            .global_batch_size = c.plan.global_batch_size};
  const Outcome a = run(m, serial, 10, true), b = run(m, c.plan, 10, true);
  for (std::size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_NEAR(b.losses[i], a.losses[i], 1e-4 * a.losses[i]) << "step " << i + 1;
}

const Case kShardedCases[] = {
    {"dp2",
     0,
     {.data_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .distributed_optimizer = true}},
    {"tp2_sp_dp2",
     0,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .distributed_optimizer = true}},
    {"cp2_dp2",
     0,
     {.context_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .distributed_optimizer = true}},
    {"moe_dp2",
     4,
     {.data_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .distributed_optimizer = true}},
    {"moe_dp4_ep2",
     4,
     {.expert_parallel = 2,
      .data_parallel = 4,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .distributed_optimizer = true}},
};

INSTANTIATE_TEST_SUITE_P(Plans, DistributedOptimizer, ::testing::ValuesIn(kShardedCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(DistributedOptimizer, EachReplicaKeepsItsShareOfTheOptimizerState) {
  const ModelConfig m = tiny(0);
  auto state_bytes = [&](bool sharded) {
    ParallelPlan plan{.data_parallel = 4,
                      .micro_batch_size = 1,
                      .global_batch_size = 4,
                      .distributed_optimizer = sharded};
    validate(m, plan);
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    TrainingStep step(m, plan, {}, set, comm);
    return set.memory().current(0, rt::MemoryCategory::optimizer_state);
  };
  const std::int64_t whole = state_bytes(false), sharded = state_bytes(true);
  EXPECT_GT(whole, 0);
  EXPECT_EQ(sharded * 4, whole);
}

// Ampipe: degree N equals degree 1 (dropless routing), which is the one-device model.
class Ampipe : public ::testing::TestWithParam<Case> {};

// Loss, aux loss and gradients of one step, and a 10-step loss curve, against one device.
void expect_equals_serial(const ModelConfig& m, const ParallelPlan& plan) {
  const ParallelPlan serial{.micro_batch_size = plan.micro_batch_size,
                            .global_batch_size = plan.global_batch_size};
  const Outcome a = run(m, serial, 1, false), b = run(m, plan, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * std::max(a.aux[0], 1e-3));
  expect_same_gradients(a, b);
  const Outcome a10 = run(m, serial, 10, true), b10 = run(m, plan, 10, true);
  for (std::size_t i = 0; i < a10.losses.size(); ++i)
    EXPECT_NEAR(b10.losses[i], a10.losses[i], 1e-4 * a10.losses[i]) << "step " << i + 1;
}

TEST_P(Ampipe, LossGradientsAndCurveEqualSerial) {
  expect_equals_serial(tiny(4), GetParam().plan);
}

TEST(Ampipe, DegreeThreeEqualsSerial) {
  ModelConfig m = tiny(4);
  m.seq_length = 24;  // 3 chunks, and 3 x 2 pieces under SP
  expect_equals_serial(m, {.expert_parallel = 2,
                           .data_parallel = 2,
                           .micro_batch_size = 2,
                           .global_batch_size = 4,
                           .ampipe_degree = 3});
  expect_equals_serial(m, {.tensor_parallel = 2,
                           .sequence_parallel = true,
                           .expert_parallel = 2,
                           .micro_batch_size = 1,
                           .global_batch_size = 2,
                           .ampipe_degree = 3,
                           .pipe_experts = true,
                           .pipe_experts_multi_data = 6});
}

const Case kAmpipeCases[] = {
    {"degree2", 4, {.micro_batch_size = 2, .global_batch_size = 4, .ampipe_degree = 2}},
    {"degree4", 4, {.micro_batch_size = 2, .global_batch_size = 4, .ampipe_degree = 4}},
    {"degree2_ep2",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"degree4_ep4",
     4,
     {.expert_parallel = 4,
      .data_parallel = 4,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 4}},
    {"degree2_dp2",
     4,
     {.data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4, .ampipe_degree = 2}},
    // Under SP every tensor-parallel rank holds one piece of each chunk.
    {"degree2_tp2sp",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"degree4_tp2sp_ep2",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 4}},
    {"degree2_tp4sp_ep4",
     4,
     {.tensor_parallel = 4,
      .sequence_parallel = true,
      .expert_parallel = 4,
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2}},
    // Under CP the chunks are the two balanced halves; chunk 1 reuses the ring's blocks.
    {"degree2_cp2",
     4,
     {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4, .ampipe_degree = 2}},
    {"degree2_cp4_ep2",
     4,
     {.context_parallel = 4,
      .expert_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2}},
    // The blocks sent round the ring again in backward instead of kept.
    {"degree2_cp4_ep2_resend_kv",
     4,
     {.context_parallel = 4,
      .expert_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .ampipe_cp_resend_kv = true}},
    {"degree2_cp2_dp2_ep4",
     4,
     {.context_parallel = 2,
      .expert_parallel = 4,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    // --use-pipe-experts: items of one local expert (and capacity slice) each.
    {"pipe_experts_ep2",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .pipe_experts = true}},
    {"degree2_pipe_experts_multi_data4_separate_streams_ep2",
     4,
     {.expert_parallel = 2,
      .data_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_separate_streams = true,
      .pipe_experts_multi_data = 4}},
    {"degree2_pipe_experts_tp2sp_ep4",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 4,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_multi_data = 4}},
    {"degree2_pipe_experts_cp2_ep2",
     4,
     {.context_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .pipe_experts = true,
      .pipe_experts_separate_streams = true,
      .pipe_experts_multi_data = 2}},
    // Without SP each tp rank routes its slice of every chunk, the chunk's output gathered.
    {"degree2_tp2_ep2",
     4,
     {.tensor_parallel = 2,
      .expert_parallel = 2,
      .micro_batch_size = 2,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"degree2_tp2sp_dp2_ep4",
     4,
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 4,
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
};

INSTANTIATE_TEST_SUITE_P(Plans, Ampipe, ::testing::ValuesIn(kAmpipeCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Under SP a tp rank routes, per chunk, the piece of the contiguous chunk MindSpeed's
// permutation gives it: S / (N tp) consecutive positions with their own capacity. So with a
// capacity that drops, tp 2 + SP at degree 2 routes and drops exactly what one device does at
// degree 4, whose chunks are those pieces.
TEST(Ampipe, UnderSequenceParallelismDropsWhatMindSpeedDrops) {
  ModelConfig m = tiny(4);
  m.moe_layer_freq = 1;
  m.moe_expert_capacity_factor = 0.5;
  const ParallelPlan split{.tensor_parallel = 2,
                           .sequence_parallel = true,
                           .expert_parallel = 2,
                           .data_parallel = 2,
                           .micro_batch_size = 1,
                           .global_batch_size = 4,
                           .ampipe_degree = 2};
  const ParallelPlan one{.micro_batch_size = 1, .global_batch_size = 4, .ampipe_degree = 4};
  const Outcome a = run(m, one, 1, false), b = run(m, split, 1, false);
  ASSERT_GT(a.dropped[0], 0) << "the capacity must drop picks for the test to mean anything";
  EXPECT_EQ(b.dropped[0], a.dropped[0]);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
}

// The step reports the MoE picks it routed and those full experts dropped: none when dropless;
// with a capacity, at least what the experts' summed capacity cannot take, per Ampipe chunk.
TEST(Ampipe, ReportsDroppedPicksWithCapacityPerChunk) {
  ModelConfig m = tiny(4);
  m.moe_layer_freq = 1;
  ParallelPlan plan{.expert_parallel = 2,
                    .data_parallel = 2,
                    .micro_batch_size = 2,
                    .global_batch_size = 8,
                    .ampipe_degree = 2};
  auto picks = [&](double factor) {
    ModelConfig mc = m;
    mc.moe_expert_capacity_factor = factor;
    validate(mc, plan);
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    TrainingStep step(mc, plan, {}, set, comm);
    fill_batches(step, mc, plan);
    step.prepare(1, 1e-3);
    set.executor().run(step.graph());
    return std::pair{step.result().routed_picks, step.result().dropped_picks};
  };
  // Every token of the global batch picks topk experts in every MoE layer.
  const std::int64_t all =
      std::int64_t{m.seq_length} * plan.global_batch_size * m.num_layers * m.moe_router_topk;
  EXPECT_EQ(picks(0).first, all);
  EXPECT_EQ(picks(0).second, 0);
  EXPECT_EQ(picks(4.0).second, 0);  // capacity above any expert's load
  // Capacity 0.5: a chunk routes n = S B / 2 tokens (per rank: its micro-batch), each of the E
  // experts takes ceil(0.5 n k / E) picks; every chunk drops at least the rest.
  const auto [routed, dropped] = picks(0.5);
  EXPECT_EQ(routed, all);
  const std::int64_t n = std::int64_t{m.seq_length} * plan.micro_batch_size / 2;
  const std::int64_t kept_per_chunk =
      m.num_experts * ((n * m.moe_router_topk + 2 * m.num_experts - 1) / (2 * m.num_experts));
  const std::int64_t chunks =
      std::int64_t{plan.global_batch_size / plan.micro_batch_size} * 2 * m.num_layers;
  EXPECT_GE(dropped, chunks * (n * m.moe_router_topk - kept_per_chunk));
  EXPECT_LT(dropped, all);
}

// MoE all-to-all time during which the device computes nothing, in a virtual-clock trace.
rt::Nanos exposed_all_to_all(const rt::Trace& trace) {
  constexpr std::string_view kAllToAll[] = {"dispatch", "combine"};
  return rt::exposed_comm_named(trace, kAllToAll);
}

TEST(Ampipe, VirtualClockHidesEachChunksAllToAllBehindAnotherChunk) {
  // Accelerators of 10 TFLOP/s on a 20 GB/s link: an all-to-all costs about what a chunk's
  // attention does, the regime Ampipe is for.
  ModelConfig m = tiny(4);
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  m.hidden_size = 256;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 512;
  m.seq_length = 512;
  m.hidden_dropout = 0;
  const devices::MachineModel model({0, 0}, 1e13, devices::LinkModel::preset("ampipe-20gbps"));
  std::map<int, rt::Nanos> exposed;
  std::map<int, rt::Trace> traces;
  for (int degree : {1, 2}) {
    ParallelPlan plan{.expert_parallel = 2,
                      .data_parallel = 2,
                      .micro_batch_size = 1,
                      .global_batch_size = 2,
                      .ampipe_degree = degree};
    validate(m, plan);
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    TrainingStep step(m, plan, {}, set, comm);
    fill_batches(step, m, plan);
    step.prepare(1, 1e-3);
    rt::VirtualClock clock(model, {.execute = true});
    traces[degree] = clock.run(step.graph()).trace;
    exposed[degree] = exposed_all_to_all(traces[degree]);
  }
  ASSERT_GT(exposed[1], 0);
  EXPECT_LE(exposed[2], exposed[1] / 2)
      << "degree 1: " << exposed[1] << " ns, degree 2: " << exposed[2] << " ns exposed";
  // Chunk 0's dispatch runs while chunk 1's attention computes.
  const rt::Span* dispatch = traces[2].find("L0.c0.dispatch[0]");
  const rt::Span* attention = traces[2].find("L0.c1.attention");
  ASSERT_TRUE(dispatch && attention);
  EXPECT_LT(dispatch->start, attention->end);
  EXPECT_GT(dispatch->end, attention->start);
}

TEST(Ampipe, TheLayerAbovesWeightGradientRunsWhileTheFirstCombineGradientMoves) {
  // Without tp and cp the QKV weight gradient of layer 1 waits for layer 0's backward to launch
  // its first all-to-all, so the compute engine has work while it is in flight.
  ModelConfig m = tiny(4);
  m.moe_layer_freq = 1;
  m.hidden_size = 256;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 512;
  m.seq_length = 512;
  m.hidden_dropout = 0;
  const devices::MachineModel model({0, 0}, 1e13, devices::LinkModel::preset("ampipe-20gbps"));
  for (int degree : {1, 2}) {
    ParallelPlan plan{.expert_parallel = 2,
                      .data_parallel = 2,
                      .micro_batch_size = 1,
                      .global_batch_size = 2,
                      .ampipe_degree = degree};
    validate(m, plan);
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    TrainingStep step(m, plan, {}, set, comm);
    fill_batches(step, m, plan);
    step.prepare(1, 1e-3);
    rt::VirtualClock clock(model, {.execute = true});
    const rt::Trace trace = clock.run(step.graph()).trace;
    const rt::Span* wg = trace.find("L1.qkv_weight_grad");
    const rt::Span* a2a =
        trace.find(degree == 1 ? "L0.combine_backward[0]" : "L0.c1.combine_backward[0]");
    ASSERT_TRUE(wg && a2a) << "degree " << degree;
    EXPECT_LT(wg->start, a2a->end) << "degree " << degree;
    EXPECT_GT(wg->end, a2a->start) << "degree " << degree;
  }
}

TEST(Ampipe, PipeExpertsComputeOneItemWhileTheNextOnesRowsMove) {
  ModelConfig m = tiny(4);
  m.num_layers = 1;
  m.moe_layer_freq = 1;
  m.hidden_size = 256;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 512;
  m.seq_length = 512;
  m.hidden_dropout = 0;
  const devices::MachineModel model({0, 0}, 1e13, devices::LinkModel::preset("ampipe-20gbps"));
  ParallelPlan plan{.expert_parallel = 2,
                    .data_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 2,
                    .pipe_experts = true,
                    .pipe_experts_separate_streams = true};
  ASSERT_TRUE(validate(m, plan).empty());
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  fill_batches(step, m, plan);
  step.prepare(1, 1e-3);
  rt::VirtualClock clock(model, {.execute = true});
  const rt::Trace trace = clock.run(step.graph()).trace;
  // Two local experts, two items: item 0's experts run while item 1's rows are in flight, and
  // item 0's combine leaves on its own stream while item 1 computes.
  const rt::Span* experts0 = trace.find("L0.i0.experts");
  const rt::Span* dispatch1 = trace.find("L0.i1.dispatch[0]");
  const rt::Span* combine0 = trace.find("L0.i0.combine[0]");
  const rt::Span* experts1 = trace.find("L0.i1.experts");
  ASSERT_TRUE(experts0 && dispatch1 && combine0 && experts1);
  EXPECT_LT(experts0->start, dispatch1->end);
  EXPECT_GT(experts0->end, dispatch1->start);
  EXPECT_LT(combine0->start, experts1->end);
  EXPECT_EQ(trace.tasks().stream_name(trace.tasks()[combine0->task].stream), "ep_combine");
}

TEST(TrainingStep, GradientsAreReducedInOneCollectivePerBucket) {
  const ModelConfig m = tiny(4);
  ParallelPlan plan{.tensor_parallel = 2,
                    .sequence_parallel = true,
                    .data_parallel = 2,
                    .micro_batch_size = 1,
                    .global_batch_size = 4};
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  const rt::Graph& g = step.graph();
  int dp_reductions = 0, tp_reductions = 0;
  for (rt::TaskId t = 0; t < g.size(); ++t) {
    if (g.tasks()[t].device != 0) continue;
    const std::string_view name = g.tasks().name(t);
    dp_reductions += name.ends_with(".dp[0]") || name.ends_with(".dp[1]");
    tp_reductions += name.ends_with(".tp[0]") || name.ends_with(".tp[1]");
  }
  const auto& buckets = step.shard(0).buckets();
  int partial = 0;
  for (const auto& b : buckets)
    partial += b.reduction == GradientReduction::tensor_partial;
  EXPECT_EQ(dp_reductions, static_cast<int>(buckets.size()));
  EXPECT_EQ(tp_reductions, partial);
  // Every parameter's gradient lives inside its bucket.
  for (const Parameter& p : step.shard(0).parameters()) {
    const GradientBucket& b = step.shard(0).bucket_of(p);
    EXPECT_GE(p.grad.data(), b.grads.data());
    EXPECT_LE(p.grad.data() + p.grad.numel(), b.grads.data() + b.grads.numel());
  }
}

TEST(TrainingStep, TwoRunsAreBitwiseIdentical) {
  const ModelConfig m = tiny(4);
  const ParallelPlan p{.tensor_parallel = 2,
                       .sequence_parallel = true,
                       .micro_batch_size = 2,
                       .global_batch_size = 4};
  const Outcome a = run(m, p, 3, true), b = run(m, p, 3, true);
  EXPECT_EQ(a.losses, b.losses);
}

// Megatron-Core checks each bucket for NaN before its data-parallel collective and stops the run
// there (start_grad_sync's check_for_nan_in_grad): weights of 1e30 overflow the attention scores,
// the loss and every gradient turn NaN, and the step fails in the bucket's ".check" task, before
// any reduction, naming the bucket.
TEST(TrainingStepChecks, ANonFiniteGradientStopsTheStepBeforeItsReduction) {
  ModelConfig m = tiny(0);
  m.init_method_std = 1e30;
  ParallelPlan plan{.data_parallel = 2,
                    .micro_batch_size = 2,
                    .global_batch_size = 4,
                    .distributed_optimizer = true,
                    .overlap_grad_reduce = true};
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  fill_batches(step, m, plan);
  step.prepare(1, 1e-2);
  try {
    set.executor().run(step.graph());
    ADD_FAILURE() << "a NaN gradient went through the reductions";
  } catch (const rt::TaskError& e) {
    EXPECT_TRUE(e.task_name().ends_with(".check")) << e.task_name();
    EXPECT_NE(std::string(e.what()).find("non-finite gradient"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace weave::graphs
