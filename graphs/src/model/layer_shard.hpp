// One layer's parameters on one rank, as its spec composes the layer: its attention's, the MLP
// norm the layer applies, and one MLP's (dense or MoE). Each module's parameters are a struct of
// that module's, which it declares and reads; the layer only holds them.
#pragma once

#include <stdexcept>
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
  // The MLP's parameters, of the kind the layer's spec chose; asking for the other kind is a bug
  // in the caller's dispatch on LayerSpec::mlp.
  const DenseMlpParameters& dense_mlp() const {
    if (const auto* dense = std::get_if<DenseMlpParameters>(&mlp)) return *dense;
    throw std::logic_error(
        "a MoE layer's dense MLP parameters were asked for: dispatch on the layer's LayerSpec");
  }
  const MoeMlpParameters& moe_mlp() const {
    if (const auto* moe = std::get_if<MoeMlpParameters>(&mlp)) return *moe;
    throw std::logic_error(
        "a dense layer's MoE MLP parameters were asked for: dispatch on the layer's LayerSpec");
  }
};

}  // namespace weave::graphs
