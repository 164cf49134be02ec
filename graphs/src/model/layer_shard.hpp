// One layer's parameters on one rank, as its spec composes the layer: its attention's, the MLP
// norm the layer applies, and one MLP's (dense or MoE). Each module's parameters are a struct of
// that module's, which it declares and reads; the layer only holds them.
#pragma once

#include <variant>

#include "model/attention_parameters.hpp"
#include "model/dense_mlp_parameters.hpp"
#include "moe/moe_parameters.hpp"

namespace weave::graphs {

struct LayerShard {
  AttentionParameters attention;
  Parameter* ln2_weight = nullptr;  // the MLP's norm
  Parameter* ln2_bias = nullptr;    // null with RMSNorm
  std::variant<DenseMlpParameters, MoeMlpParameters> mlp;

  bool moe() const { return std::holds_alternative<MoeMlpParameters>(mlp); }
  const DenseMlpParameters& dense_mlp() const { return std::get<DenseMlpParameters>(mlp); }
  const MoeMlpParameters& moe_mlp() const { return std::get<MoeMlpParameters>(mlp); }
};

}  // namespace weave::graphs
