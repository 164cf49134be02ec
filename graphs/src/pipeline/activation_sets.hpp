// Which activation set each forward of a pipeline schedule takes: one chunk's activations for
// one micro-batch in flight, free again after the backward that used them (its weight half, when
// the backward is split). Derived from the schedule alone, so every rank computes the same.
#pragma once

#include <map>
#include <tuple>
#include <vector>

#include "weave/graphs/model_config.hpp"
#include "weave/graphs/pipeline_layout.hpp"

namespace weave::graphs {

struct ActivationSetPlan {
  std::vector<std::vector<int>> set_chunks;            // [pp][set]: the chunk it is laid out for
  std::map<std::tuple<int, int, int>, int> set_index;  // (pp, chunk, micro-batch) -> set
  std::vector<int> output_sets;                        // [pp]: output sets (last chunk's rank)
  std::map<int, int> output_index;                     // micro-batch -> output set
  std::vector<int> chunk_of_layer;
  bool splits_backward = false;  // the schedule has I actions

  int set(int pp, int chunk, int micro_batch) const {
    return set_index.at({pp, chunk, micro_batch});
  }
};

// A rank's chunks with the same layers (count and kinds) share their sets, as a caching
// allocator would reuse the memory; the loss buffers have sets of their own.
ActivationSetPlan plan_activation_sets(const ModelConfig& model, const PipelineLayout& layout);

}  // namespace weave::graphs
