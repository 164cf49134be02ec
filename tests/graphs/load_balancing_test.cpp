// Megatron-Core's --moe-router-load-balancing-type seq_aux_loss and sinkhorn in training: each
// changes the step, and the parallel plans give the one device's loss, aux loss and gradients
// (seq_aux_loss under tensor + sequence + expert + data parallelism, context parallelism and
// Ampipe; sinkhorn, which balances each rank's tokens as Megatron-Core's router does, under expert
// + data parallelism, where every rank routes whole micro-batches, and under tp + SP, where each
// rank balances its shard of the sequence).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {
namespace {

void expect_same_step(const Outcome& a, const Outcome& b) {
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * a.aux[0]);
  expect_same_gradients(a, b);
}

TEST(LoadBalancing, SeqAuxLossEqualsOneDeviceUnderTpSpEpDpCpAndAmpipe) {
  ModelConfig m = tiny(4);
  m.moe_aux_loss_coeff = 0.1;
  m.moe_load_balancing = MoeLoadBalancing::seq_aux_loss;
  const ParallelPlan serial{.micro_batch_size = 2, .global_batch_size = 4};
  const Outcome a = run(m, serial, 1, false);
  expect_same_step(a, run(m,
                          {.tensor_parallel = 2,
                           .sequence_parallel = true,
                           .expert_parallel = 2,
                           .data_parallel = 2,
                           .micro_batch_size = 2,
                           .global_batch_size = 4},
                          1, false));
  expect_same_step(
      a, run(m, {.context_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}, 1, false));
  expect_same_step(a, run(m,
                          {.tensor_parallel = 2,
                           .sequence_parallel = true,
                           .expert_parallel = 2,
                           .micro_batch_size = 2,
                           .global_batch_size = 4,
                           .ampipe_degree = 2},
                          1, false));
  // The micro-batch's two sequences balanced apart is not their tokens balanced together...
  ModelConfig whole = m;
  whole.moe_load_balancing = MoeLoadBalancing::aux_loss;
  const Outcome b = run(whole, serial, 1, false);
  EXPECT_GT(std::abs(b.aux[0] - a.aux[0]), 1e-4 * a.aux[0]);
  // ...and one sequence a micro-batch is.
  const ParallelPlan single{.micro_batch_size = 1, .global_batch_size = 4};
  EXPECT_NEAR(run(m, single, 1, false).aux[0], run(whole, single, 1, false).aux[0],
              1e-6 * a.aux[0]);
}

TEST(LoadBalancing, SinkhornRoutingEqualsOneDeviceUnderEpDp) {
  ModelConfig m = tiny(4);
  m.moe_aux_loss_coeff = 0;  // Megatron-Core's sinkhorn takes no balancing loss
  m.moe_load_balancing = MoeLoadBalancing::sinkhorn;
  const ParallelPlan serial{.micro_batch_size = 2, .global_batch_size = 4};
  const Outcome a = run(m, serial, 1, false);
  const Outcome b = run(
      m, {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4},
      1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  expect_same_gradients(a, b);
  ModelConfig top1 = m;
  top1.moe_router_topk = 1;
  const Outcome c = run(top1, serial, 1, false);
  const Outcome d =
      run(top1,
          {.expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4},
          1, false);
  EXPECT_NEAR(d.losses[0], c.losses[0], 1e-5 * c.losses[0]);
  expect_same_gradients(c, d);
  // It routes otherwise than the top-k of the renormalised softmax.
  ModelConfig plain = m;
  plain.moe_load_balancing = MoeLoadBalancing::aux_loss;
  EXPECT_NE(run(plain, serial, 1, false).losses[0], a.losses[0]);
}

// Under tp 2 + SP each tensor-parallel rank routes its own shard of the sequence, and Megatron-
// Core's router balances the logits it is given, the rank's [s / tp, b] tokens
// (TopKRouter.routing -> sinkhorn_load_balancing, no gather): the step is not one device's,
// which balances the whole sequence at once, but each half balanced apart, as tp 2 without SP
// gives (its ranks route the same halves of the replicated sequence).
TEST(LoadBalancing, SinkhornUnderTpSpBalancesEachRanksShardAsMegatronDoes) {
  ModelConfig m = tiny(4);
  m.moe_aux_loss_coeff = 0;
  m.moe_load_balancing = MoeLoadBalancing::sinkhorn;
  const Outcome one = run(m, {.micro_batch_size = 1, .global_batch_size = 2}, 1, false);
  const Outcome sp = run(m,
                         {.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .micro_batch_size = 1,
                          .global_batch_size = 2},
                         1, false);
  const Outcome halves =
      run(m, {.tensor_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2}, 1, false);
  EXPECT_NEAR(sp.losses[0], halves.losses[0], 1e-5 * halves.losses[0]);
  expect_same_gradients(halves, sp);
  // Picks routed otherwise move the experts' gradients far beyond the equal-one-device tests'
  // 1e-4 of a parameter's largest element.
  double apart = 0;
  for (const auto& [name, want] : one.grads) {
    const std::vector<double>& got = sp.grads.at(name);
    double scale = 0, most = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      scale = std::max(scale, std::abs(want[i]));
      most = std::max(most, std::abs(got[i] - want[i]));
    }
    if (scale > 0) apart = std::max(apart, most / scale);
  }
  EXPECT_GT(apart, 1e-2) << "balancing the halves apart must route otherwise than the whole "
                            "sequence for the test to mean anything";
}

TEST(LoadBalancing, SinkhornRefusesWhatMegatronRefusesOrIgnores) {
  ModelConfig m = tiny(4);
  m.moe_load_balancing = MoeLoadBalancing::sinkhorn;
  const ParallelPlan plan{.micro_batch_size = 2, .global_batch_size = 4};
  auto refusal = [&](const ModelConfig& c, ParallelPlan p) {
    try {
      validate(c, p);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal(m, plan).find("--moe-aux-loss-coeff 0.01: give 0"), std::string::npos);
  m.moe_aux_loss_coeff = 0;
  EXPECT_EQ(refusal(m, plan), "");
  ModelConfig capacity = m;
  capacity.moe_expert_capacity_factor = 1.5;
  EXPECT_NE(refusal(capacity, plan).find("Megatron-Core's rule"), std::string::npos);
  ModelConfig sigmoid = m;
  sigmoid.moe_router_score_function = "sigmoid";
  EXPECT_NE(refusal(sigmoid, plan).find("would ignore"), std::string::npos);
  ParallelPlan ampipe = plan;
  ampipe.ampipe_degree = 2;
  EXPECT_NE(refusal(m, ampipe).find("--ampipe-degree 2 routes them by chunk"), std::string::npos);
  ModelConfig gate = m;
  gate.moe_gate = MoeGate::deepspeed;
  gate.moe_z_loss_coeff = 0;  // MindSpeed's gate has none
  EXPECT_NE(refusal(gate, plan).find("MindSpeed's deepspeed_moe gate balances"), std::string::npos);
}

}  // namespace
}  // namespace weave::graphs
