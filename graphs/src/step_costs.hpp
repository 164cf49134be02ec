// The virtual clock's price of the step's compute: the multiply-adds (x2) of the matrix products
// and attention each task runs, from the shapes it multiplies. Element-wise work is small beside
// them and costs nothing here.
#pragma once

#include <cstdint>

#include "step_shape.hpp"

namespace weave::graphs::cost {

// A [rows, in] x [in, out] product.
inline double matmul(std::int64_t rows, std::int64_t in, std::int64_t out) {
  return 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
}

// Causal attention of a rank's Sc query rows (B sequences, Hl heads) against the whole
// sequence's keys: the scores and the weighted values, over half of the (query, key) pairs on
// average.
inline double causal_attention(const StepShape& z) {
  return 2 * 2 * static_cast<double>(z.B * z.Hl * z.Sc) * static_cast<double>(z.S / z.cp * z.cp) *
         static_cast<double>(z.d) * 0.5;
}

// Attention backward: five products against forward's two.
inline double causal_attention_backward(const StepShape& z) {
  return 2.5 * causal_attention(z);
}

// The share of the causal attention's (query, key) pairs that Ampipe chunk c's queries take: a
// piece of q queries from sequence row `first` sees q (2 first + q) / Sc^2 of them.
inline double ampipe_causal_share(const StepShape& z, int c) {
  double share = 0;
  for (int j = 0; j < z.t_sp; ++j) {
    const double q = static_cast<double>(z.piece_rows());
    const double first = static_cast<double>(z.piece_start(c, j));
    share += q * (2 * first + q) / (static_cast<double>(z.Sc) * static_cast<double>(z.Sc));
  }
  return share;
}

// The attention's output projection of the rank's Sc rows: [Sc B, Hl d] x [Hl d, h].
inline double projection(const StepShape& z) {
  return matmul(z.Sc * z.B, z.Hl * z.d, z.h);
}

// The QKV projection: [Sc B, h] x [h, (Hl + 2 Gl) d] (3 Hl d without grouped-query attention).
inline double qkv(const StepShape& z) {
  return matmul(z.Sc * z.B, z.h, z.qkv_width());
}

// The experts' two products over a slot's expected rows (its tokens' top-k picks, balanced),
// for `tokens` routed tokens.
inline double experts(const StepShape& z, double tokens) {
  return 2 * tokens * static_cast<double>(z.model.moe_router_topk) * static_cast<double>(z.h) *
         static_cast<double>(z.expert_f1() + z.f);
}

// The router's logits: [tokens, h] x [h, E].
inline double router(const StepShape& z, double tokens) {
  return 2 * tokens * static_cast<double>(z.h) * static_cast<double>(z.model.num_experts);
}

}  // namespace weave::graphs::cost
