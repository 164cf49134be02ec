// What the decoding tests build for each layout: a step, its devices and a generator over its
// (freshly initialised) shards; and a model without dropout.
#pragma once

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

}  // namespace weave::graphs
