// Sinkhorn balancing of routing logits, as MindSpeed's deepspeed_moe gate applies it with
// --moe-use-sinkhorn (mindspeed/moe/gate.py calls Megatron-Core's moe_utils.sinkhorn on the gate's
// logits before its softmax, and back-propagates through the iterations).
//
// With C = exp(logits) [t, e], the token and expert scales start at d1 = 1 and alternate
//   d0[t] = (1 / tokens) / (sum_e d1[e] C[t, e] + eps),
//   d1[e] = (1 / experts) / (sum_t d0[t] C[t, e] + eps),
// until the mean absolute change of d1 in one round is at most the tolerance; the result is
// d0[t] C[t, e] d1[e], whose columns each sum to about 1 / experts and rows to 1 / tokens. The
// rounds run in double precision (MindSpeed's in the logits' fp32), so a converged result agrees
// to the tolerance, not bit for bit.
#pragma once

#include "weave/ops/tensor.hpp"

namespace weave::ops {

inline constexpr double kSinkhornTolerance = 1e-4;  // Megatron-Core's default
inline constexpr double kSinkhornEpsilon = 1e-8;    // added to every sum before dividing
// More rounds than converging needs; a run that reaches it stops with an error instead of looping
// for ever: non-finite logits, or a tolerance below about 1e-7, where eps (which breaks the
// scales' invariance under d0 c, d1 / c) keeps d1 drifting by about that much a round.
inline constexpr int kSinkhornMaxRounds = 10000;

// out [t, e] = the balanced logits (out may be logits). Returns the rounds taken. Throws
// std::runtime_error naming the change left when kSinkhornMaxRounds do not converge.
template <typename T>
int sinkhorn_forward(const BasicTensor<T>& logits, const BasicTensor<T>& out,
                     double tolerance = kSinkhornTolerance);

// d_logits [t, e] (written; it may be d_out) from d_out through every round of the forward, which
// it recomputes from `logits`: the gradient autograd takes through the loop, not that of the fixed
// point.
template <typename T>
void sinkhorn_backward(const BasicTensor<T>& logits, const BasicTensor<T>& d_out,
                       const BasicTensor<T>& d_logits, double tolerance = kSinkhornTolerance);

}  // namespace weave::ops
