// What one rank holds while its step runs: per micro-batch in flight the activations each layer
// keeps for its backward, the gradient workspace its layers share, and its results. Data only:
// the rank program (rank_program.hpp) allocates it and its tasks read and write it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>
#include <variant>
#include <vector>

#include "model/attention_activations.hpp"
#include "model/dense_mlp_activations.hpp"
#include "model/output_workspace.hpp"
#include "model/ring_attention_workspace.hpp"
#include "moe/moe_activations.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/ops/tensor.hpp"
#include "weave/runtime/types.hpp"

namespace weave::graphs {

using ops::Tensor;

// Everything a layer's forward keeps for its backward, on one device, for one micro-batch in
// flight (see ActivationSet): the residual stream and the MLP's norm, which the layer owns, its
// attention's state and the state of the one MLP its LayerSpec chooses (dense, or MoE for a MoE
// or Ampipe layer), which that MLP's allocate sets.
struct LayerActivations {
  Tensor x_in;  // [Sl, B, h]: the previous layer's output
  Tensor x_mid;
  Tensor ln2, ln2_mean, ln2_rstd, ln2_full;
  ops::Bf16Tensor ln2_16;  // a bf16 run: the MLP norm's output, kept in bf16 (ln2 undefined)
  Tensor mlp_out;          // [Sl, B, h]: the MLP's output, before bias and dropout
  Tensor x_out;
  AttentionActivations attention;
  std::variant<DenseMlpActivations, MoeActivations> mlp;

  // The MLP's state, of the kind the layer's spec chose; asking for the other kind is a bug in
  // the caller's dispatch on LayerSpec::mlp.
  DenseMlpActivations& dense() {
    if (auto* dense = std::get_if<DenseMlpActivations>(&mlp)) return *dense;
    throw std::logic_error(
        "a MoE layer's dense MLP activations were asked for: dispatch on the layer's LayerSpec");
  }
  MoeActivations& moe() {
    if (auto* moe = std::get_if<MoeActivations>(&mlp)) return *moe;
    throw std::logic_error(
        "a dense layer's MoE activations were asked for (or before MoeMlp::allocate): dispatch "
        "on the layer's LayerSpec");
  }
};

// A bf16 run's conversions: fp32 values on their way into bf16 (a norm's output under SP, RoPE's
// rotation, the gradients the products take) and the bf16 results of products on their
// way into the fp32 residual stream and loss. Shared by every layer of the device; each tensor
// is used within one task but for d_fc1_16, d_qkv16 and d_logits16, which carry the output
// gradients to the weight halves as d_fc1, d_qkv and d_logits do.
struct HalfWorkspace {
  Tensor norm_out;                       // sequence parallelism: a norm's output [Sl, B, h]
  Tensor gathered;                       // sequence parallelism: norm_out's gather [Sc, B, h]
  Tensor qkv32;                          // [Sc, B, Gl, qkv group width]
  ops::Bf16Tensor out16, d_out16;        // [Sc, B, h]
  ops::Bf16Tensor d_act16, d_fc1_16;     // [Sc, B, fl], [Sc, B, f1l]
  ops::Bf16Tensor d_attn16, d_qkv16;     // [Sc, B, Hl d], [Sc, B, Gl, qkv group width]
  ops::Bf16Tensor logits16, d_logits16;  // [Sc B, Vl]; logits16 counted by a prediction too
};

// --tp-comm-overlap's staging buffers ([Sc, B, h] each, as the userbuffers Transformer Engine
// registers per rank): a piece of a gather lands in rank order before its rows move to their
// places in the whole sequence, and a piece of a reduce-scatter is laid out in rank order before
// it is reduced. One for the forward's gathers, one for its reduce-scatters, one for the
// backward's gathers; each remembers the last task of its latest use, which the next use waits
// for (tp_comm_overlap.hpp).
struct TpOverlapStage {
  Tensor buffer;
  rt::TaskId last_use = rt::kNoTask;
};
struct TpOverlapStages {
  TpOverlapStage gather, scatter, grad_gather;
};

// Gradient workspace shared by all layers of a device: the backward runs layer after layer. The
// layer's own (its residual stream's and norms' gradients, which its modules pass between them)
// and each module's part.
struct BackwardWorkspace {
  Tensor d_x, d_x_mid, d_tmp;  // [Sl, B, h]
  Tensor d_mlp, d_mlp_full;    // [Sl, B, h], [S, B, h]
  Tensor d_norm_full;          // [S, B, h]
  Tensor d_norm;               // [Sl, B, h]
  TpOverlapStages tp_overlap;  // --tp-comm-overlap only
  AttentionWorkspace attention;
  DenseMlpWorkspace dense_mlp;
  SharedExpertWorkspace shared_expert;  // with shared experts only
  RingAttentionWorkspace cp_ring;       // context parallelism only
  OutputWorkspace output;               // the last stage only
  HalfWorkspace half;                   // bf16 runs only
  // StepShape::experts_reduce_under_weight_gradient: the gradient of the experts' first product,
  // kept from the backward's input half for its weight half, which runs next while fc1's input
  // gradient is reduced over tp (one slot's rows at a time: [tp capacity, expert f1 / tp], or
  // routed replicated [capacity, expert f1 / tp]).
  Tensor experts_d_pre;
};

// The activations one model chunk keeps for one micro-batch, from its forward until its
// backward has used them. A rank holds as many sets as its schedule has (chunk, micro-batch)
// forwards in flight at once (one without pipelining; p - r on 1F1B's stage r), so the device's
// activation memory is the schedule's. When the rank's chunks have the same layers (count and
// kinds) the sets are shared by all of them, as a caching allocator would reuse the memory;
// otherwise each chunk has its own.
struct ActivationSet {
  std::vector<LayerActivations> layers;  // by position in the chunk
  // The chunk's input [Sl, B, h]: the previous stage's output, or the embedding's. Under SP the
  // first chunk's embedding sums [Sc, B, h] partials first.
  Tensor x_in, emb_partial;
  // Pipelining: the gradient of the chunk's output from the next stage, and of its input for the
  // previous (both [Sl, B, h]).
  Tensor d_recv, d_send;
  std::vector<std::int32_t> tokens;  // [Sc B]: this rank's positions of the micro-batch
};

// The last chunk's final norm, output layer and cross-entropy for one micro-batch in flight.
struct OutputSet {
  Tensor final_ln, final_mean, final_rstd, final_full, logits;
  Tensor row_max, partials, lse;
  std::vector<std::int32_t> targets;  // [Sc B]
  Tensor saved_d_logits;              // a split backward: the output layer's gradient, for W
  ops::Bf16Tensor saved_d_logits16;   // the same in a bf16 run: the bf16 its products read
  ops::Bf16Tensor final16;            // a bf16 run: the final norm's output (final_ln undefined)
};

// Selective recomputation of the norms (--recompute-modules layernorm): a norm's output (fp32,
// under SP its gather too, or a 16-bit run's bf16 one) and its statistics, shared by the same
// norm of every layer and set of the rank. Its forward writes them for the module it feeds
// (QKV, the MLP) to read at once; its backward computes them again right before that module's
// backward, whose weight gradient and the norm's own backward read them. A field is allocated
// when some layer first takes it (a 16-bit run's MoE layers keep their norm's output in fp32).
struct RecomputedNorm {
  Tensor out, full, mean, rstd;
  ops::Bf16Tensor out16;
};

struct RankState {
  std::unique_ptr<ModelShard> shard;
  std::vector<ActivationSet> sets;
  // Full recomputation: what the layers of one recomputed group hold while their forward runs
  // again and their backward uses it, shared by every group and set of the rank (one group is
  // recomputed at a time), by (position in the group, MoE layer). The sets' recomputed layers
  // are views of it but for their input and the group's output.
  std::map<std::pair<int, bool>, LayerActivations> recompute_working_set;
  // Selective recomputation of the dense MLP (--recompute-modules mlp): fc1's output, the
  // activation and fc2's partial sums, shared by every recomputed MLP of the rank (one is
  // recomputed at a time, right before its backward).
  DenseMlpActivations recomputed_dense_mlp;
  // Selective recomputation of the experts' activation (--recompute-modules moe_act): the hidden
  // layer after the activation [slot rows, expert f / etp], shared by every MoE slot of the rank.
  // A slot's forward writes it and fc2 reads it within one task; the task that reads it for fc2's
  // weight gradient computes it again first from the kept first product.
  Tensor recomputed_expert_hidden;
  // --recompute-modules layernorm: the input norm's and the pre-MLP norm's working sets.
  RecomputedNorm recomputed_input_norm, recomputed_mlp_norm;
  // Selective recomputation of the MoE layer (--recompute-modules moe): everything a MoE layer's
  // MLP holds (its slot's router, dispatcher and experts state, its router statistics, its
  // shared experts' state) and its output, shared by every MoE layer of the rank; each keeps its
  // input (the pre-MLP norm's output) and runs its forward again right before its backward.
  LayerActivations recomputed_moe_layer;
  std::vector<OutputSet> outputs;
  BackwardWorkspace ws;
  Tensor norm_sq;    // [1]: this rank's share of the squared grad norm
  Tensor found_inf;  // [1], with a loss scaler: 1 if some gradient is not finite (max over ranks)
  std::vector<double> loss, aux;                     // per micro-batch
  std::int64_t routed_picks = 0, dropped_picks = 0;  // this rank's tokens, the whole step
  std::uint64_t routing_digest = 0;                  // StepResult::routing_digest's share
  // --moe-router-enable-expert-bias: by MoE layer of the stage, [experts] picks each expert kept
  // (after drops) of this rank's tokens over the step, as Megatron-Core's local_tokens_per_expert.
  std::map<int, Tensor> expert_loads;
};

}  // namespace weave::graphs
