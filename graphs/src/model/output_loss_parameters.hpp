// The model end's parameters on one rank (the last stage's), declared by
// OutputLoss::declare_parameters. Tied, the output layer reads the word embedding
// (EmbeddingParameters) instead of a weight of its own.
#pragma once

#include "weave/graphs/model_shard.hpp"

namespace weave::graphs {

struct OutputLossParameters {
  Parameter* final_norm_weight = nullptr;  // [h], replicated
  Parameter* final_norm_bias = nullptr;    // null with RMSNorm
  // --untie-embeddings-and-output-weights: local [vocabulary shard, h] like the word embedding.
  Parameter* output_weight = nullptr;
};

}  // namespace weave::graphs
