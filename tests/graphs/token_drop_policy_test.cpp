// Megatron-Core's --moe-token-drop-policy probs in training: with a capacity that drops, a plan
// whose ranks route the same tokens per call as one device (expert and data parallelism; tp + SP
// against the one device's Ampipe chunks) gives its loss, dropped picks and every gradient; and
// the policy changes which picks are dropped.
#include <gtest/gtest.h>

#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {
namespace {

ModelConfig probs_model() {
  ModelConfig m = tiny(4);
  m.moe_layer_freq = 1;
  m.seq_length = 32;
  m.moe_expert_capacity_factor = 1.0;
  m.moe_token_drop_by_probability = true;
  return m;
}

TEST(TokenDropPolicy, ProbsEqualsOneDeviceUnderExpertAndDataParallelism) {
  const ModelConfig m = probs_model();
  const Outcome a = run(m, {.micro_batch_size = 1, .global_batch_size = 4}, 1, false);
  const Outcome b = run(
      m, {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 4},
      1, false);
  ASSERT_GT(a.dropped[0], 0);
  EXPECT_EQ(b.dropped[0], a.dropped[0]);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
}

TEST(TokenDropPolicy, ProbsEqualsOneDeviceUnderSequenceParallelism) {
  const ModelConfig m = probs_model();
  const Outcome a =
      run(m, {.micro_batch_size = 2, .global_batch_size = 2, .ampipe_degree = 2}, 1, false);
  const Outcome b = run(m,
                        {.tensor_parallel = 2,
                         .sequence_parallel = true,
                         .micro_batch_size = 2,
                         .global_batch_size = 2},
                        1, false);
  ASSERT_GT(a.dropped[0], 0);
  EXPECT_EQ(b.dropped[0], a.dropped[0]);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  expect_same_gradients(a, b);
}

TEST(TokenDropPolicy, ProbsAndPositionDropDifferentPicks) {
  ModelConfig m = probs_model();
  const ParallelPlan one{.micro_batch_size = 2, .global_batch_size = 2};
  const Outcome probs = run(m, one, 1, false);
  m.moe_token_drop_by_probability = false;
  const Outcome position = run(m, one, 1, false);
  // The same number of picks over capacity, different ones kept.
  EXPECT_EQ(probs.dropped[0], position.dropped[0]);
  EXPECT_NE(probs.losses[0], position.losses[0]);
}

}  // namespace
}  // namespace weave::graphs
