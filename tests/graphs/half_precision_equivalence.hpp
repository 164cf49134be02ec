// The 16-bit tests' models, and a 16-bit run under a parallel plan against one device running the
// same micro-batches: the first step's loss, aux loss and every gradient, then the losses of two
// more steps with updates, each within a tolerance the calling test derives from its format's
// unit roundoff and the roundings the plan adds (bf16_training_test.cpp, fp16_training_test.cpp,
// bf16_moe_training_test.cpp); the expert-parallel plan with Ampipe and its tolerance; 16-bit
// gradients against fp32 ones; two loss-scaled steps.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "step_outcome.hpp"
#include "tiny_model.hpp"

namespace weave::graphs {

// GPT-2's decoder (LayerNorm, GELU, learned positions, biases, tied output) and Llama's (RMSNorm,
// SwiGLU, RoPE, grouped-query attention, no biases, an untied output layer), 2 dense layers.
inline ModelConfig gpt() {
  ModelConfig m = tiny(0);
  m.hidden_size = 64;
  m.ffn_hidden_size = 128;
  return m;
}

inline ModelConfig llama() {
  return with_modern_decoder(gpt());
}

inline ModelConfig in(ModelConfig m, Precision p) {
  m.precision = p;
  return m;
}

// Relative difference of two gradients in norm.
inline double relative_difference(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

struct ParallelTolerance {
  double first_loss;  // relative, the first step's loss and aux loss (no update yet)
  double gradient;    // relative in norm, every parameter's gradient of the first step
  double later_loss;  // relative, the losses of steps 2 and 3 (with updates)
};

// Expert parallelism moves 16-bit values (exactly) and changes no rounding: the experts run the
// same rows in the same products. What differs is the order of fp32 sums (the data-parallel
// reduction of the replicated parameters' gradients, a few additions of relative 2^-24): the
// first loss and aux loss agree to 1e-6, the gradients to 1e-5 (an fp32 ulp flips the rounding of
// a rare 16-bit value, one u of one element), the later steps to 1e-4 (bf16_training_test's dp
// argument).
constexpr ParallelTolerance kExpertParallel{1e-6, 1e-5, 1e-4};

// The experts over 2 ranks of 2 data-parallel replicas, each micro-batch in Ampipe's 2 chunks.
inline const ParallelPlan kEp2Ampipe2{.expert_parallel = 2,
                                      .data_parallel = 2,
                                      .micro_batch_size = 2,
                                      .global_batch_size = 4,
                                      .ampipe_degree = 2};

// Every parameter's gradient of a 16-bit run (`half`, in `format`) against the fp32 model's:
// within `bound` of the fp32 gradient's norm, and not equal to it (the format's roundings
// reached it). Returns the worst relative difference.
inline double expect_gradients_within(const std::map<std::string, std::vector<float>>& fp32,
                                      const std::map<std::string, std::vector<float>>& half,
                                      double bound, std::string_view format) {
  double worst = 0;
  for (const auto& [name, want] : fp32) {
    const std::vector<float>& got = half.at(name);
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
      norm += double{want[i]} * want[i];
    }
    EXPECT_LE(std::sqrt(diff), bound * std::sqrt(norm)) << name;
    EXPECT_GT(diff, 0) << name << ": not computed in " << format;
    worst = std::max(worst, std::sqrt(diff / norm));
  }
  return worst;
}

// Two steps of the same batch, the second after an update, the loss scaled by `scale` when `opt`
// scales it: losses, aux losses and every rank's unscaled gradients of the second (by
// "name@rank"), and whether each step's scaled gradients overflowed.
struct ScaledSteps {
  Outcome outcome;
  std::vector<bool> found_inf;
};

inline ScaledSteps two_scaled_steps(const ModelConfig& m, const ParallelPlan& plan,
                                    const OptimizerConfig& opt, double learning_rate, float scale) {
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, opt, set, comm);
  ScaledSteps out;
  for (int it = 1; it <= 2; ++it) {
    fill_batches(step, m, plan);
    step.prepare(it, learning_rate);
    if (opt.loss_scaling) step.set_loss_scale(scale);
    set.executor().run(step.graph());
    out.found_inf.push_back(step.result().found_inf);
    out.outcome.losses.push_back(step.result().loss);
    out.outcome.aux.push_back(step.result().aux_loss);
  }
  for (int r = 0; r < plan.devices(); ++r)
    for (const Parameter& p : step.shard(r).parameters()) {
      const std::vector<float> g = p.grad.to_vector();
      out.outcome.grads[fmt::format("{}@{}", p.name, r)].assign(g.begin(), g.end());
    }
  return out;
}

// One device runs the plan's micro-batches (the same size and number a step), so the fp32 sums
// over them are the same.
inline void expect_equals_one_device_of_its_batches(const ModelConfig& m, const ParallelPlan& plan,
                                                    const ParallelTolerance& tolerance) {
  const ParallelPlan serial{.micro_batch_size = plan.micro_batch_size,
                            .global_batch_size = plan.global_batch_size};
  const Outcome a = run(m, serial, 1, false), b = run(m, plan, 1, false);
  EXPECT_LE(std::abs(b.losses[0] - a.losses[0]), tolerance.first_loss * a.losses[0]);
  EXPECT_LE(std::abs(b.aux[0] - a.aux[0]), tolerance.first_loss * a.aux[0]);
  // A pipeline alone: its boundaries send the 16-bit stream's values (fp32 ones with
  // --fp32-residual-connection), which one device holds as they are, so the first loss, a
  // forward's, is one device's bit for bit.
  if (plan.pipeline_parallel > 1 && plan.devices() == plan.pipeline_parallel) {
    EXPECT_EQ(b.losses[0], a.losses[0]);
  }
  if (!plan.distributed_optimizer) {  // a replica keeps its shard of the reduced gradients only
    for (const auto& [name, want] : a.grads)
      EXPECT_LE(relative_difference(b.grads.at(name), want), tolerance.gradient) << name;
  }
  const Outcome a3 = run(m, serial, 3, true), b3 = run(m, plan, 3, true);
  for (std::size_t i = 1; i < a3.losses.size(); ++i)
    EXPECT_NEAR(b3.losses[i], a3.losses[i], tolerance.later_loss * a3.losses[i])
        << "step " << i + 1;
  EXPECT_LT(b3.losses.back(), b3.losses.front());
}

}  // namespace weave::graphs
