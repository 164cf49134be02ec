// --moe-layer-freq's value as Megatron-LM reads it (its moe_freq_type): a whole number N, one MoE
// layer every N layers from the first, or a pattern of one entry per layer, 1 for a MoE layer and
// 0 for a dense one, as DeepSeek-V3's three dense first layers are "([0]*3+[1]*58)".
#pragma once

#include <string_view>

#include "weave/graphs/model_config.hpp"

namespace weave::graphs {

// Sets m.moe_layer_freq (a whole number) or m.moe_layer_pattern (a pattern) from `text`.
// Megatron-LM evaluates a pattern as a Python expression; weave reads only these forms of it:
//   a list of 0s and 1s                          [0,1,1,0]
//   a list times a count                         [0]*3
//   a sum of those, optionally in parentheses    ([0]*3+[1]*5)
//   a parenthesised sum times a count            ([1]*3+[0]*1)*3
// Anything else throws ConfigError naming the accepted forms. The pattern's length is checked
// against --num-layers with the plan's rules (validate).
void set_moe_layer_freq(ModelConfig& m, std::string_view text);

// The value as --moe-layer-freq spells it: the whole number, or the pattern as a list.
std::string moe_layer_freq_text(const ModelConfig& m);

}  // namespace weave::graphs
