// A tiny GPT-MoE configuration and a fixed pseudo-random text, shared by the graphs tests.
#pragma once

#include <cstdint>

#include "weave/graphs/training_step.hpp"

namespace weave::graphs {

inline ModelConfig tiny(int experts) {
  ModelConfig m{.num_layers = 2,
                .hidden_size = 32,
                .num_attention_heads = 4,
                .ffn_hidden_size = 64,
                .seq_length = 16,
                .vocab_size = 60,
                .make_vocab_size_divisible_by = 16,  // 64 rows for tp up to 4
                .hidden_dropout = 0.1,
                .num_experts = experts,
                .moe_layer_freq = 2,
                .moe_router_topk = 2,
                .moe_aux_loss_coeff = 0.01,
                .moe_z_loss_coeff = 0.001};
  return m;
}

// `m` with Llama's decoder in place of GPT-2's: RMSNorm, SwiGLU, RoPE, 2 key/value heads shared by
// the query heads, no biases, an untied output layer, attention dropout.
inline ModelConfig with_modern_decoder(ModelConfig m) {
  m.activation = Activation::swiglu;
  m.position_embedding = PositionEmbedding::rope;
  m.normalization = Normalization::rms_norm;
  m.layernorm_epsilon = 1e-6;
  m.num_query_groups = 2;
  m.untie_embeddings_and_output_weights = true;
  m.add_bias_linear = false;
  m.attention_dropout = 0.1;
  return m;
}

// Tokens of global sample j at position s: a fixed pseudo-random text.
inline std::int32_t token(std::int64_t sample, std::int64_t position, int vocab) {
  std::uint64_t x = static_cast<std::uint64_t>(sample * 1009 + position * 7919 + 17);
  x ^= x >> 13;
  x *= 0x9E3779B97F4A7C15ull;
  return static_cast<std::int32_t>((x >> 33) % static_cast<std::uint64_t>(vocab));
}

// Global sample j of the batch goes to data-parallel rank j / (M B), micro-batch (j / B) % M.
inline void fill_batches(TrainingStep& step, const ModelConfig& m, const ParallelPlan& plan,
                         std::int64_t first_sample = 0) {
  const int M = plan.micro_batches(), B = plan.micro_batch_size, S = m.seq_length;
  for (int dp = 0; dp < plan.data_parallel; ++dp)
    for (int mb = 0; mb < M; ++mb) {
      MicroBatch& batch = step.micro_batch(dp, mb);
      for (int bi = 0; bi < B; ++bi) {
        const std::int64_t sample = first_sample + (dp * M + mb) * B + bi;
        for (int s = 0; s < S; ++s) {
          batch.tokens[s * B + bi] = token(sample, s, m.vocab_size);
          batch.targets[s * B + bi] = token(sample, s + 1, m.vocab_size);
        }
      }
    }
}

}  // namespace weave::graphs
