// tools/demo's model and plan, as `weave train` makes them from the demo's flags (the learning
// rate as the demo warms it up), for the benchmarks that measure against the demo's run.
#pragma once

#include <cstdint>

#include "weave/graphs/trainer_config.hpp"

namespace weave::bench {

inline graphs::TrainerConfig demo_config(std::int64_t iterations) {
  graphs::TrainerConfig c;
  c.model = {.num_layers = 4,
             .hidden_size = 128,
             .num_attention_heads = 8,
             .ffn_hidden_size = 256,
             .seq_length = 128,
             .num_experts = 4,
             .moe_layer_freq = 2,
             .moe_router_topk = 2,
             .moe_aux_loss_coeff = 0.01};
  c.plan = {.tensor_parallel = 2,
            .sequence_parallel = true,
            .expert_parallel = 2,
            .data_parallel = 2,
            .micro_batch_size = 4,
            .global_batch_size = 16,
            .ampipe_degree = 2};
  c.learning_rate = {.lr = 3e-3, .min_lr = 3e-4, .warmup_iters = 20};
  c.train_iters = iterations;
  return c;
}

}  // namespace weave::bench
