// A layer's self-attention: input norm, QKV projection, causal attention (a ring of key/value
// blocks under context parallelism), the output projection and its reduction over the tensor-
// parallel group (a reduce-scatter under sequence parallelism), forward and backward.
//
// Shapes on a rank: x [Sl, B, h] -> norm [Sl, B, h] -> (SP all-gather) [Sc, B, h] -> qkv
// [Sc, B, Hl, 3d] -> attention [Sc, B, Hl, d] -> projection partial sums [Sc, B, h] -> (reduce)
// proj_out [Sl, B, h].
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "model/attention_parameters.hpp"
#include "model/parameter_declarer.hpp"
#include "step/rank_program.hpp"
#include "step/weight_halves.hpp"
#include "weave/ops/attention.hpp"

namespace weave::graphs {

class AttentionBlock {
 public:
  AttentionBlock(RankProgram& rank, int layer) : P(&rank), l(layer) {}

  // Norm, SP gather and QKV on the whole local sequence (Ampipe's chunks split only the queries).
  // Returns the QKV task.
  TaskId forward_input(const BuildPosition& pos, TaskId ready) const;
  // The whole block: returns the task after which proj_out holds the projection's sum.
  TaskId forward(const BuildPosition& pos, TaskId ready) const;

  // From the projection output's gradient in the workspace's d_mlp (this rank's rows): the
  // projection's and attention's backward, then backward_input. `last`: the micro-batch's last
  // backward, after which the attention bucket is reduced. Returns the input norm's backward.
  TaskId backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves, bool last,
                  WeightPlacement qkv_weights) const;
  // The backward of forward_input from the QKV gradient in d_qkv: QKV input gradient (with the
  // ring's key/value gradients under CP), its reduction over tp, the QKV weight half (placed as
  // `qkv_weights` says) and the input norm; then the attention bucket's reduction.
  // `norm_again`: the input norm's recomputation (input_norm_again), which the QKV weight half
  // reads.
  TaskId backward_input(const BuildPosition& pos, TaskId ready, WeightHalves& halves, bool last,
                        WeightPlacement qkv_weights, TaskId norm_again = rt::kNoTask) const;
  // --recompute-modules layernorm: the input norm's forward again from the layer's kept input
  // (its SP gather too, and a bf16 run's rounding into the QKV product's input), into the rank's
  // working set, after `ready`; as Megatron-Core's TransformerLayer recomputes input_layernorm
  // when the attention's output gradient arrives. Returns its last task (kNoTask when the norm
  // is kept).
  TaskId input_norm_again(const BuildPosition& pos, TaskId ready) const;

  // Lays out what the block keeps for one micro-batch (Ampipe's chunked log-sum-exps and, under
  // CP, its store of every rank's key/value block on a MoE layer).
  void allocate(LayerActivations& A) const;

  // Declares the input norm, QKV and output projection of layer `layer` into `L`.
  static void declare_parameters(ParameterDeclarer& declare, const LayerSpec& spec, int layer,
                                 AttentionParameters& L);

 private:
  // forward's local attention under --tp-comm-overlap: the core attention, then the projection
  // in pieces, each reduce-scattered while the next is computed (after `qkv`).
  TaskId forward_in_pieces(const BuildPosition& pos, TaskId qkv) const;
  // forward_input's gather and QKV product under --tp-comm-overlap, in pieces (after `ln1`).
  TaskId qkv_in_pieces(const BuildPosition& pos, TaskId ln1) const;
  // backward's local attention under --tp-comm-overlap: the projection's input gradient in
  // pieces as the output gradient's gather arrives, then its weight half (unless `keep`) and the
  // core attention's backward. Returns the last.
  TaskId backward_in_pieces(const BuildPosition& pos, TaskId ready, bool keep) const;

  RankProgram* P;
  int l;
};

// Part `part` (0 k, 1 v) of a [s, B, Gl, 2 d] key/value block, seen as [B, s, Gl, d] for the
// attention kernel.
inline Tensor head_view(const Tensor& t, std::int64_t d, std::int64_t part) {
  return t.slice(3, part * d, d).transpose(0, 1);
}

// The [s, B, Gl, (qpg + 2) d] QKV tensor (or its gradient) as the attention kernel reads it:
// the queries [B, s, Gl, qpg d], the keys and the values [B, s, Gl, d].
template <typename T>
ops::BasicTensor<T> query_view(const ops::BasicTensor<T>& qkv, const StepShape& z) {
  return qkv.slice(3, 0, z.qpg * z.d).transpose(0, 1);
}
template <typename T>
ops::BasicTensor<T> key_view(const ops::BasicTensor<T>& qkv, const StepShape& z) {
  return qkv.slice(3, z.qpg * z.d, z.d).transpose(0, 1);
}
template <typename T>
ops::BasicTensor<T> value_view(const ops::BasicTensor<T>& qkv, const StepShape& z) {
  return qkv.slice(3, (z.qpg + 1) * z.d, z.d).transpose(0, 1);
}
// An attention output (or its gradient) of s rows, stored [s, B, Hl, d] (or [s, B, Hl d]), as the
// kernel reads it: [B, s, Gl, qpg d], each group's query heads side by side.
template <typename T>
ops::BasicTensor<T> output_view(const ops::BasicTensor<T>& t, const StepShape& z) {
  return t.reshape({t.dim(0), z.B, z.Gl, z.qpg * z.d}).transpose(0, 1);
}

// The attention's input projection, shared by training and decoding: normed rows x [s, B, h]
// (or [s, h]) projected into qkv [s, B, Gl, (qpg + 2) d] (or [s, 1, Gl, ...]), then the layer's
// query/key stages in the spec's order (`state`: each one's saved state) and the rotation of the
// queries and keys to `positions`, the global positions of the s rows (--position-embedding-type
// rope).
void project_qkv(const LayerSpec& spec, const ModelConfig& m, const AttentionParameters& W,
                 const Tensor& x, const Tensor& qkv, std::span<const std::int64_t> positions,
                 const std::vector<StageState>& state);
// Its backward up to the projection's output, in place on the QKV gradient d_qkv: the rotation
// undone, then the stages' backward in reverse order (their parameters' gradients accumulated).
void project_qkv_backward(const LayerSpec& spec, const ModelConfig& m, const AttentionParameters& W,
                          const Tensor& d_qkv, std::span<const std::int64_t> positions,
                          const std::vector<StageState>& state);
// The stages' saved state for `at`'s rows, from `allocate`.
std::vector<StageState> allocate_query_key_stages(
    const LayerSpec& spec, const std::function<Tensor(const ops::Shape&)>& allocate,
    const QkvRows& at);
// The stages' cost on the rank's rows, added to the QKV task's.
rt::CostHint query_key_stages_cost(const LayerSpec& spec, const StepShape& z, bool backward);
// Decoding one token at a time: what project_qkv keeps for the token's one row beyond its QKV,
// each stage's saved state. Every layer's attention has the same spec, so one state serves them
// all.
struct AttentionDecodeState {
  std::vector<StageState> query_key;
};
AttentionDecodeState allocate_attention_decoding(
    const LayerSpec& spec, const std::function<Tensor(const ops::Shape&)>& allocate,
    std::int64_t Gl, std::int64_t qpg, std::int64_t d);
// project_qkv of the token's one row at `positions` (one), as decoding runs it.
inline void project_qkv(const LayerSpec& spec, const ModelConfig& m, const AttentionParameters& W,
                        const Tensor& x, const Tensor& qkv, std::span<const std::int64_t> positions,
                        const AttentionDecodeState& state) {
  project_qkv(spec, m, W, x, qkv, positions, state.query_key);
}
// The global positions of this rank's Sc rows.
std::vector<std::int64_t> context_positions(const RankProgram& rank);

// The attention kernel's dropout for layer `layer`, micro-batch `mb` (--attention-dropout).
ops::AttentionDropout attention_dropout(const RankProgram& rank, int layer, int mb);

}  // namespace weave::graphs
