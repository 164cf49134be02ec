// Megatron-Core's aux-loss-free expert bias in training: after every step each MoE layer's bias
// moves by the update rate towards the mean load, the same on every rank of tensor + sequence +
// expert + data parallelism as on one device (losses too, as the bias steers the routing), and a
// checkpoint keeps it.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "step_outcome.hpp"
#include "temp_dir.hpp"
#include "weave/graphs/checkpoint.hpp"

namespace weave::graphs {
namespace {

ModelConfig biased_model() {
  ModelConfig m = tiny(8);
  m.moe_router_score_function = "sigmoid";
  m.moe_router_enable_expert_bias = true;
  m.moe_router_bias_update_rate = 0.05;
  m.moe_aux_loss_coeff = 0;
  return m;
}

using Biases = std::map<std::string, std::vector<float>>;

// Every rank's expert biases, by name; each name's copies must agree.
Biases biases_of(TrainingStep& step, const ParallelPlan& plan) {
  Biases out;
  for (int r = 0; r < plan.devices(); ++r)
    for (const ModelState& s : step.shard(r).states()) {
      const std::vector<float> v(s.value.data(), s.value.data() + s.value.numel());
      const auto [it, first] = out.emplace(s.name, v);
      if (!first) {
        EXPECT_EQ(it->second, v) << s.name << " differs on rank " << r;
      }
    }
  return out;
}

struct BiasedRun {
  std::vector<double> losses;
  std::vector<Biases> biases;  // after each step
};

BiasedRun train(const ModelConfig& m, ParallelPlan plan, int steps) {
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  BiasedRun out;
  for (int it = 1; it <= steps; ++it) {
    fill_batches(step, m, plan);
    step.prepare(it, 1e-2);
    set.executor().run(step.graph());
    out.losses.push_back(step.result().loss);
    out.biases.push_back(biases_of(step, plan));
  }
  return out;
}

TEST(ExpertBias, MovesTowardsTheMeanLoadAlikeOnEveryRankAsOnOneDevice) {
  const ModelConfig m = biased_model();
  const ParallelPlan serial{.micro_batch_size = 1, .global_batch_size = 4};
  const ParallelPlan plan{.tensor_parallel = 2,
                          .sequence_parallel = true,
                          .expert_parallel = 2,
                          .data_parallel = 2,
                          .micro_batch_size = 1,
                          .global_batch_size = 4};
  const BiasedRun a = train(m, serial, 3), b = train(m, plan, 3);
  const double rate = m.moe_router_bias_update_rate;
  for (int s = 0; s < 3; ++s) {
    EXPECT_NEAR(b.losses[s], a.losses[s], 1e-5 * a.losses[s]) << "step " << s + 1;
    ASSERT_EQ(a.biases[s].size(), 1u);  // one MoE layer of two
    for (const auto& [name, want] : a.biases[s]) {
      const std::vector<float>& got = b.biases[s].at(name);
      int up = 0, down = 0;
      for (std::size_t e = 0; e < want.size(); ++e) {
        EXPECT_NEAR(got[e], want[e], 1e-7) << name << " expert " << e << " step " << s + 1;
        // Each step moves each expert's bias by -rate, 0 or +rate.
        const double before = s == 0 ? 0.0 : a.biases[s - 1].at(name)[e];
        const double moved = (want[e] - before) / rate;
        EXPECT_TRUE(std::abs(moved) < 1e-4 || std::abs(std::abs(moved) - 1) < 1e-4)
            << name << " expert " << e << " step " << s + 1 << " moved " << moved << " x rate";
        up += moved > 0.5;
        down += moved < -0.5;
      }
      // 4 x 16 tokens x 2 picks over 8 experts: some experts under the mean, some over.
      EXPECT_GT(up, 0) << "step " << s + 1;
      EXPECT_GT(down, 0) << "step " << s + 1;
    }
  }
  EXPECT_NE(a.biases[1], a.biases[0]);
  // The moved bias steers the routing: the third step differs from one with a still bias.
  ModelConfig still = m;
  still.moe_router_bias_update_rate = 0;
  EXPECT_NE(train(still, serial, 3).losses[2], a.losses[2]);
}

TEST(ExpertBias, AStepThatDoesNotUpdateLeavesIt) {
  // An evaluation's step (no update) leaves the bias, as Megatron-Core moves it only in training.
  const ModelConfig m = biased_model();
  ParallelPlan plan{.micro_batch_size = 1, .global_batch_size = 2};
  validate(m, plan);
  devices::DeviceSet set(1, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  const Biases zero = biases_of(step, plan);
  fill_batches(step, m, plan);
  step.prepare(1, 1e-2);
  step.set_update_parameters(false);
  set.executor().run(step.graph());
  EXPECT_EQ(biases_of(step, plan), zero);
  step.set_update_parameters(true);
  set.executor().run(step.graph());
  EXPECT_NE(biases_of(step, plan), zero);
}

TEST(ExpertBias, CheckpointKeepsIt) {
  const ModelConfig m = biased_model();
  ParallelPlan plan{
      .expert_parallel = 2, .data_parallel = 2, .micro_batch_size = 1, .global_batch_size = 2};
  validate(m, plan);
  TempDir dir("expert_bias");
  const std::string path = dir.prefix("ckpt");
  Biases saved;
  {
    devices::DeviceSet set(plan.devices(), {.pin = false});
    devices::SharedMemoryCommunicator comm;
    TrainingStep step(m, plan, {}, set, comm);
    for (int it = 1; it <= 2; ++it) {
      fill_batches(step, m, plan);
      step.prepare(it, 1e-2);
      set.executor().run(step.graph());
    }
    saved = biases_of(step, plan);
    save_checkpoint(path, m, plan, step, {.iteration = 2});
  }
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep fresh(m, plan, {}, set, comm);
  const Biases zero = biases_of(fresh, plan);
  ASSERT_NE(zero, saved);  // the bias moved in training; a fresh step starts at zero
  load_checkpoint(path, m, plan, fresh);
  EXPECT_EQ(biases_of(fresh, plan), saved);
}

}  // namespace
}  // namespace weave::graphs
