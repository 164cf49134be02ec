// What the checkpoint fuzz target does with one input, shared with the regression tests: the
// file loaded into a tiny model's training step (one device, a checkpoint of a few kilobytes).
// Throws what the reader refuses files with: std::runtime_error naming what does not match.
#pragma once

#include <string>

#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"

namespace weave::fuzz {

struct TinyCheckpointStep {
  graphs::ModelConfig model{.num_layers = 1,
                            .hidden_size = 8,
                            .num_attention_heads = 2,
                            .ffn_hidden_size = 16,
                            .seq_length = 4,
                            .vocab_size = 16,
                            .make_vocab_size_divisible_by = 16};
  graphs::ParallelPlan plan = [this] {
    graphs::ParallelPlan p{.micro_batch_size = 1, .global_batch_size = 1};
    graphs::validate(model, p);
    return p;
  }();
  devices::DeviceSet devices{1, {.pin = false}};
  devices::SharedMemoryCommunicator comm;
  graphs::TrainingStep step{model, plan, {}, devices, comm};

  graphs::CheckpointState load(const std::string& path) {
    return graphs::load_checkpoint(path, model, plan, step);
  }
};

}  // namespace weave::fuzz
