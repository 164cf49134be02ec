// The 16-bit tests' models, and a 16-bit run under a parallel plan against one device running the
// same micro-batches: the first step's loss, aux loss and every gradient, then the losses of two
// more steps with updates, each within a tolerance the calling test derives from its format's
// unit roundoff and the roundings the plan adds (bf16_training_test.cpp, fp16_training_test.cpp,
// bf16_moe_training_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
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

// One device runs the plan's micro-batches (the same size and number a step), so the fp32 sums
// over them are the same.
inline void expect_equals_one_device_of_its_batches(const ModelConfig& m, const ParallelPlan& plan,
                                                    const ParallelTolerance& tolerance) {
  const ParallelPlan serial{.micro_batch_size = plan.micro_batch_size,
                            .global_batch_size = plan.global_batch_size};
  const Outcome a = run(m, serial, 1, false), b = run(m, plan, 1, false);
  EXPECT_LE(std::abs(b.losses[0] - a.losses[0]), tolerance.first_loss * a.losses[0]);
  EXPECT_LE(std::abs(b.aux[0] - a.aux[0]), tolerance.first_loss * a.aux[0]);
  // Not one device's by accident: a pipeline's boundaries round the stream.
  if (plan.pipeline_parallel > 1) {
    EXPECT_NE(b.losses[0], a.losses[0]);
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
