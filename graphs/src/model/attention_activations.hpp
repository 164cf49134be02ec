// What a layer's attention keeps for its backward, on one device, for one micro-batch in flight,
// and the gradient workspace its backward uses.
#pragma once

#include <vector>

#include "model/query_key_stage.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::graphs {

using ops::Tensor;

struct AttentionActivations {
  Tensor ln1, ln1_mean, ln1_rstd, ln1_full;
  Tensor qkv, attn, lse, proj_partial, proj_out;
  // --attention-backend unfused or local: the scores' softmax output, dropout output and mask
  // [B, Hl, Sc, S] (the mask one byte a score), held for the backward; weave's own kernel
  // recomputes what it needs, so these are held and counted, not written.
  Tensor probabilities, dropped_probabilities, dropout_mask;
  Tensor kv_local;  // context parallelism: this rank's keys and values [Sc, B, Gl, 2d]
  // Ampipe under CP, unless the blocks are sent again in backward: every cp rank's block, by
  // owner [cp Sc, B, Gl, 2d] (kv_local is this rank's slot).
  Tensor kv_store;
  // A split backward (zero-bubble schedules): the out-projection's and QKV's output gradients,
  // kept from the input-gradient half (I) until the weight half (W) runs.
  Tensor saved_d_proj, saved_d_qkv;
  std::vector<StageState> query_key;  // each of the spec's query/key stages' own
  // A bf16 run keeps the products' inputs in bf16 instead of ln1_full, qkv and attn (undefined
  // then): the norm's output, the queries, keys and values, the attention's output.
  ops::Bf16Tensor ln1_16, qkv16, attn16;
  // A bf16 run's split backward keeps the output gradients in the bf16 its products read.
  ops::Bf16Tensor saved_d_proj16, saved_d_qkv16;
};

// The attention's share of the backward's workspace, one per device for all its layers (the
// backward runs layer after layer): the attention output's and QKV's gradients. A 16-bit run
// has no d_attn: its gradient is the bf16 one the products read (HalfWorkspace::d_attn16).
struct AttentionWorkspace {
  Tensor d_attn, d_qkv;  // [S, B, Hl d], [S, B, Hl, 3d]
};

}  // namespace weave::graphs
