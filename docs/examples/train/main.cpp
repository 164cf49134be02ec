// Training the GPT-MoE model from C++ with the library's training loop: a small MoE model on 2
// simulated devices (tensor parallelism 2 with sequence parallelism), synthetic data, and a
// callback that prints the loss as it falls.
#include <cstdio>

#include "weave/graphs.hpp"

int main() {
  namespace g = weave::graphs;
  g::TrainerConfig config;
  config.model = {.num_layers = 2,
                  .hidden_size = 64,
                  .num_attention_heads = 4,
                  .ffn_hidden_size = 128,
                  .seq_length = 32,
                  .num_experts = 4,
                  .moe_layer_freq = 2};
  config.plan = {.tensor_parallel = 2,
                 .sequence_parallel = true,
                 .micro_batch_size = 4,
                 .global_batch_size = 8};
  config.train_iters = 30;
  config.learning_rate = {.lr = 3e-3, .min_lr = 3e-4, .warmup_iters = 5};
  config.pin_devices = false;

  g::Trainer trainer(config, g::TrainingData::from(g::TokenDataset::mock(config.model.seq_length,
                                                                         config.model.seed)));
  const g::TrainingSummary summary = trainer.run({.iteration = [](const g::IterationMetrics& m) {
    if (m.iteration % 10 == 0 || m.iteration == 1)
      std::printf("iteration %2lld  loss %.4f  lr %.5f\n", static_cast<long long>(m.iteration),
                  m.loss, m.learning_rate);
    return g::TrainingControl::proceed;
  }});
  std::printf("trained %lld iterations: loss %.4f -> %.4f\n",
              static_cast<long long>(summary.iterations), summary.first_loss, summary.last_loss);
  return summary.last_loss < summary.first_loss ? 0 : 1;
}
