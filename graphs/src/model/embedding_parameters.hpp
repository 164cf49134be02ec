// The input embedding's parameters on one rank, declared by Embedding::declare_parameters.
#pragma once

#include "weave/graphs/model_shard.hpp"

namespace weave::graphs {

struct EmbeddingParameters {
  // Local [vocabulary shard, h]: held by the first stage, and, tied, by the last as the output
  // layer's weight; null on a stage that holds neither.
  Parameter* word = nullptr;
  // [positions, h], replicated (--position-embedding-type learned_absolute on the first stage
  // only).
  Parameter* positions = nullptr;
};

}  // namespace weave::graphs
