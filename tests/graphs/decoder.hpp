// What the decoding tests build for each layout: a step, its devices and a generator over its
// (freshly initialised) shards; a model without dropout; and decoding a training step's
// micro-batch token by token against the step's loss.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <vector>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/generator.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {

// Decoding gives the training step's values only where no dropout mask differs.
inline ModelConfig without_dropout(ModelConfig m) {
  m.hidden_dropout = 0;
  m.attention_dropout = 0;
  return m;
}

struct Decoder {
  ParallelPlan plan;
  devices::DeviceSet set;
  devices::SharedMemoryCommunicator comm;
  TrainingStep step;
  Generator generator;
  Decoder(const ModelConfig& m, ParallelPlan p)
      : plan((validate(m, p), p)),
        set(plan.devices(), {.pin = false}),
        step(m, plan, {}, set, comm),
        generator(m, plan, step, set, comm) {}
};

// One training step of m on one device (no update), then its micro-batch fed to the generator
// token by token: the mean of -log softmax(logits)[target] is the step's loss. With `split`, a
// generator over that layout is fed the same tokens and gives the same logits.
inline void expect_decoding_gives_the_steps_loss(const ModelConfig& m,
                                                 const std::optional<ParallelPlan>& split = {}) {
  const ParallelPlan plan{.micro_batch_size = 1, .global_batch_size = 1};
  Decoder one(m, plan);
  one.step.set_update_parameters(false);
  fill_batches(one.step, m, plan);
  one.step.prepare(1, 0);
  one.set.executor().run(one.step.graph());
  const MicroBatch& batch = one.step.micro_batch(0, 0);
  std::optional<Decoder> other_layout;
  if (split) other_layout.emplace(m, *split);
  one.generator.reset();
  double sum = 0;
  for (std::size_t s = 0; s < batch.tokens.size(); ++s) {
    const std::vector<float> logits = one.generator.feed(batch.tokens[s]);
    if (other_layout) {
      const std::vector<float> other = other_layout->generator.feed(batch.tokens[s]);
      ASSERT_EQ(other.size(), logits.size());
      for (std::size_t i = 0; i < logits.size(); ++i)
        ASSERT_NEAR(other[i], logits[i], 1e-4 * (1 + std::abs(logits[i])));
    }
    double top = -INFINITY, z = 0;
    for (float v : logits)
      top = std::max<double>(top, v);
    for (float v : logits)
      z += std::exp(v - top);
    sum += top + std::log(z) - logits[static_cast<std::size_t>(batch.targets[s])];
  }
  const double decoded = sum / static_cast<double>(batch.tokens.size());
  EXPECT_NEAR(decoded, one.step.result().loss, 1e-5 * decoded);
}

}  // namespace weave::graphs
