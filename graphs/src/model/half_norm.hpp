// A 16-bit run's norm written straight into the 16-bit tensor its product reads.
#pragma once

#include "weave/graphs/model_config.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::graphs {

// y16 = norm(x) rounded once to `m.precision`, with its fp32 statistics (norm_forward's), the
// rows [S, B, h] of x (fp32) computed in fp32 a block of rows at a time in a scratch of the
// block's size: no fp32 tensor of the output's size is held. Bitwise the values norm_forward
// into an fp32 tensor and round_to_half give (each row is normed on its own).
void norm_forward_to_half(const ModelConfig& m, const ops::Tensor& x, const Parameter& weight,
                          const Parameter* bias, const ops::Bf16Tensor& y16,
                          const ops::Tensor& mean, const ops::Tensor& rstd);

}  // namespace weave::graphs
