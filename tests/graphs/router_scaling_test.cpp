// Megatron-Core's --moe-router-topk-scaling-factor in training: the scaled weights change the
// step, and tensor + sequence + expert + data parallelism gives the one device's loss, aux loss
// and every gradient with them.
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

}  // namespace
}  // namespace weave::graphs
