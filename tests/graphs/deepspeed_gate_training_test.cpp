// MindSpeed's deepspeed_moe gate (ModelConfig::moe_gate = deepspeed) in training: a parallel plan
// whose ranks' gate calls see the same tokens as one device's gives that device's loss, dropped
// picks, every gradient and aux loss (the sum of the calls' losses: each sequence-parallel rank's
// calls count, not tp rank 0's alone). The gate's capacity comes from each call's own tokens, so
// the one device is given the Ampipe chunks that make its calls the parallel ranks' calls: a
// sequence-parallel rank's shard is one of its chunks. Its load-balancing loss is back-propagated
// unscaled per call and averaged over data-parallel replicas (MindSpeed's), so cases with data
// parallelism route top-1, whose loss MindSpeed discards.
#include <gtest/gtest.h>

#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {
namespace {

ModelConfig gate_model(int top_k) {
  ModelConfig m = tiny(4);
  m.moe_layer_freq = 1;
  m.seq_length = 32;
  m.moe_router_topk = top_k;
  m.moe_z_loss_coeff = 0;  // MindSpeed's deepspeed_moe layer has none
  m.moe_gate = MoeGate::deepspeed;
  return m;
}

struct Case {
  const char* name;
  int top_k;
  ParallelPlan serial, plan;
};

class DeepSpeedGateTraining : public ::testing::TestWithParam<Case> {};

TEST_P(DeepSpeedGateTraining, EqualsOneDeviceWithTheSameGateCalls) {
  const Case c = GetParam();
  const ModelConfig m = gate_model(c.top_k);
  const Outcome a = run(m, c.serial, 1, false), b = run(m, c.plan, 1, false);
  // The default capacity factor (1, MindSpeed's) drops picks of these tiny calls.
  ASSERT_GT(a.dropped[0], 0);
  EXPECT_EQ(b.dropped[0], a.dropped[0]);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  // Top-2's calls report their loss (top-1's is discarded, 0 on both).
  if (c.top_k == 2) {
    ASSERT_GT(a.aux[0], 0);
  }
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
}

const Case kCases[] = {
    {"top2_tp2_sp",
     2,
     {.micro_batch_size = 2, .global_batch_size = 4, .ampipe_degree = 2},
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .moe_model_type = "deepspeed_moe",
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"top2_tp2_sp_ampipe2_tp_sp_overlap",
     2,
     {.micro_batch_size = 1, .global_batch_size = 2, .ampipe_degree = 4},
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .moe_model_type = "deepspeed_moe",
      .micro_batch_size = 1,
      .global_batch_size = 2,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
    {"top1_ep2_dp2",
     1,
     {.micro_batch_size = 1, .global_batch_size = 4},
     {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4}},
    {"top1_tp2_sp_ep2_dp2_ampipe2",
     1,
     {.micro_batch_size = 1, .global_batch_size = 4, .ampipe_degree = 4},
     {.tensor_parallel = 2,
      .sequence_parallel = true,
      .expert_parallel = 2,
      .moe_model_type = "deepspeed_moe",
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
};

INSTANTIATE_TEST_SUITE_P(Plans, DeepSpeedGateTraining, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Under tensor parallelism without SP every tp rank gates its micro-batch's whole Ampipe chunk,
// the same tokens on each (MindSpeed's layout), its experts split over tp and their outputs
// all-reduced: one device with the same chunks makes the same gate calls, so the same drops (a
// capacity per whole chunk: per tp slice it would differ), loss, aux loss and gradients (the
// router's counted once, not summed over the tp ranks). MindSpeed averages each call's
// load-balancing gradient over the data-parallel replicas: the one device's gradients are
// compared with its coefficient divided by dp, its aux loss with the coefficient as given.
struct ReplicatedCase {
  const char* name;
  ParallelPlan serial, plan;
};

class DeepSpeedGateReplicated : public ::testing::TestWithParam<ReplicatedCase> {};

TEST_P(DeepSpeedGateReplicated, EqualsOneDeviceWithTheWholeChunks) {
  const ReplicatedCase c = GetParam();
  const ModelConfig m = gate_model(2);
  ModelConfig averaged = m;
  averaged.moe_aux_loss_coeff /= c.plan.data_parallel;
  const Outcome a = run(m, c.serial, 1, false), b = run(m, c.plan, 1, false);
  const Outcome a_grads = c.plan.data_parallel > 1 ? run(averaged, c.serial, 1, false) : a;
  ASSERT_GT(a.dropped[0], 0);
  EXPECT_EQ(b.dropped[0], a.dropped[0]);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  ASSERT_GT(a.aux[0], 0);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a_grads, b);
  // Updated by the same gradients, the curves stay the one device's.
  const ModelConfig& serial_model = c.plan.data_parallel > 1 ? averaged : m;
  const Outcome a4 = run(serial_model, c.serial, 4, true), b4 = run(m, c.plan, 4, true);
  for (std::size_t i = 0; i < a4.losses.size(); ++i)
    EXPECT_NEAR(b4.losses[i], a4.losses[i], 1e-4 * a4.losses[i]) << "step " << i + 1;
}

const ReplicatedCase kReplicatedCases[] = {
    {"tp2",
     {.micro_batch_size = 2, .global_batch_size = 4},
     {.tensor_parallel = 2,
      .moe_model_type = "deepspeed_moe",
      .micro_batch_size = 2,
      .global_batch_size = 4}},
    {"tp2_ep2_dp2_ampipe2",
     {.micro_batch_size = 1, .global_batch_size = 4, .ampipe_degree = 2},
     {.tensor_parallel = 2,
      .expert_parallel = 2,
      .moe_model_type = "deepspeed_moe",
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2}},
    {"tp2_ep2_dp2_ampipe2_tp_sp_overlap",
     {.micro_batch_size = 1, .global_batch_size = 4, .ampipe_degree = 2},
     {.tensor_parallel = 2,
      .expert_parallel = 2,
      .moe_model_type = "deepspeed_moe",
      .data_parallel = 2,
      .micro_batch_size = 1,
      .global_batch_size = 4,
      .ampipe_degree = 2,
      .ampipe_tp_sp_comm_overlap = true}},
};

INSTANTIATE_TEST_SUITE_P(Plans, DeepSpeedGateReplicated, ::testing::ValuesIn(kReplicatedCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(DeepSpeedGate, NoDropKeepsEveryPickAndTheCapacityFactorSetsTheDrops) {
  ModelConfig m = gate_model(2);
  const ParallelPlan plan{.micro_batch_size = 2, .global_batch_size = 2};
  const std::int64_t at_one = run(m, plan, 1, false).dropped[0];
  m.moe_train_capacity_factor = 0.5;
  const std::int64_t at_half = run(m, plan, 1, false).dropped[0];
  EXPECT_GT(at_half, at_one);
  m.moe_no_drop = true;
  EXPECT_EQ(run(m, plan, 1, false).dropped[0], 0);
}

TEST(DeepSpeedGate, SettingsMindSpeedRefusesAreRefused) {
  auto refused = [](const ModelConfig& m, ParallelPlan plan) {
    EXPECT_THROW(validate(m, plan), ConfigError);
  };
  const ParallelPlan one{.micro_batch_size = 1, .global_batch_size = 1};
  ModelConfig m = gate_model(2);
  m.moe_z_loss_coeff = 0.001;
  refused(m, one);
  m = gate_model(2);
  m.moe_router_topk = 3;
  refused(m, one);
  m = gate_model(2);
  m.moe_expert_capacity_factor = 1.0;
  refused(m, one);
  m = gate_model(2);  // under tp without SP its experts are split over tp
  refused(m, {.tensor_parallel = 2, .micro_batch_size = 1, .global_batch_size = 1});
  m.moe_no_drop = true;
  refused(m, {.pipeline_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2});
  // Megatron's router has none of these settings.
  m = tiny(4);
  m.moe_no_drop = true;
  refused(m, one);
  m = tiny(4);
  m.moe_use_sinkhorn = true;
  refused(m, one);
}

// --moe-use-sinkhorn: each gate call routes on its own Sinkhorn-balanced logits (the rounds'
// gradient is checked against finite differences in ops/sinkhorn_test.cpp), so ranks whose calls
// see one device's calls still give its loss, drops and gradients; and the balance changes the
// routing.
TEST(DeepSpeedGate, SinkhornBalancedCallsEqualOneDevice) {
  for (const Case& c : {kCases[0], kCases[3]}) {
    ModelConfig m = gate_model(c.top_k);
    const Outcome plain = run(m, c.serial, 1, false);
    m.moe_use_sinkhorn = true;
    const Outcome a = run(m, c.serial, 1, false), b = run(m, c.plan, 1, false);
    EXPECT_EQ(b.dropped[0], a.dropped[0]) << c.name;
    EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]) << c.name;
    expect_same_gradients(a, b);
    EXPECT_NE(a.losses[0], plain.losses[0]) << c.name;
    EXPECT_NE(a.grads.at("layers.0.moe.router.weight"),
              plain.grads.at("layers.0.moe.router.weight"))
        << c.name;
  }
}

}  // namespace
}  // namespace weave::graphs
