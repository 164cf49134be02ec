// Megatron-Core's --moe-router-topk-scaling-factor, sigmoid and sqrtsoftplus scores and
// group-limited routing in training: each changes the step, and tensor + sequence + expert + data
// parallelism gives the one device's loss, aux loss and every gradient with them.
#include <gtest/gtest.h>

#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {
namespace {

TEST(RouterScaling, ScaledWeightsEqualOneDeviceUnderTpSpEpDp) {
  ModelConfig m = tiny(4);
  m.moe_router_topk_scaling_factor = 2.5;
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .expert_parallel = 2,
                          .data_parallel = 2,
                          .micro_batch_size = 1,
                          .global_batch_size = 4};
  const Outcome a = run(m, {.micro_batch_size = 1, .global_batch_size = 4}, 1, false);
  const Outcome b = run(m, plan, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
  m.moe_router_topk_scaling_factor = 1;
  EXPECT_NE(run(m, {.micro_batch_size = 1, .global_batch_size = 4}, 1, false).losses[0],
            a.losses[0]);
}

TEST(RouterScaling, SigmoidGroupLimitedRoutingEqualsOneDeviceUnderTpSpEpDp) {
  // 8 experts in 4 groups; each token's top-3 from its 2 best groups (each scored by its best
  // expert), sigmoid scores normalised over the picks, then scaled.
  ModelConfig m = tiny(8);
  m.moe_router_topk = 3;
  m.moe_router_score_function = "sigmoid";
  m.moe_router_num_groups = 4;
  m.moe_router_group_topk = 2;
  m.moe_router_topk_scaling_factor = 2.5;
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .expert_parallel = 2,
                          .data_parallel = 2,
                          .micro_batch_size = 1,
                          .global_batch_size = 4};
  const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = 4};
  const Outcome a = run(m, serial, 1, false);
  const Outcome b = run(m, plan, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
  // Each option changes the step.
  ModelConfig ungrouped = m;
  ungrouped.moe_router_group_topk = 0;
  EXPECT_NE(run(ungrouped, serial, 1, false).losses[0], a.losses[0]);
  ModelConfig softmax = m;
  softmax.moe_router_score_function = "softmax";
  EXPECT_NE(run(softmax, serial, 1, false).losses[0], a.losses[0]);
}

TEST(RouterScaling, SqrtSoftplusGroupLimitedRoutingEqualsOneDeviceUnderTpSpEpDp) {
  // As the sigmoid case, with sqrt(softplus) scores: normalised over the picks, then scaled.
  ModelConfig m = tiny(8);
  m.moe_router_topk = 3;
  m.moe_router_score_function = "sqrtsoftplus";
  m.moe_router_num_groups = 4;
  m.moe_router_group_topk = 2;
  m.moe_router_topk_scaling_factor = 2.5;
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .expert_parallel = 2,
                          .data_parallel = 2,
                          .micro_batch_size = 1,
                          .global_batch_size = 4};
  const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = 4};
  const Outcome a = run(m, serial, 1, false);
  const Outcome b = run(m, plan, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
  // The score function changes the step: sigmoid's differs.
  ModelConfig sigmoid = m;
  sigmoid.moe_router_score_function = "sigmoid";
  EXPECT_NE(run(sigmoid, serial, 1, false).losses[0], a.losses[0]);
}

}  // namespace
}  // namespace weave::graphs
