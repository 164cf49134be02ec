// A layer's self-attention: input norm, QKV projection, causal attention (a ring of key/value
// blocks under context parallelism), the output projection and its reduction over the tensor-
// parallel group (a reduce-scatter under sequence parallelism), forward and backward.
//
// Shapes on a rank: x [Sl, B, h] -> norm [Sl, B, h] -> (SP all-gather) [Sc, B, h] -> qkv
// [Sc, B, Hl, 3d] -> attention [Sc, B, Hl, d] -> projection partial sums [Sc, B, h] -> (reduce)
// proj_out [Sl, B, h].
#pragma once

#include "rank_program.hpp"
#include "weight_halves.hpp"

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
  TaskId backward_input(const BuildPosition& pos, TaskId ready, WeightHalves& halves, bool last,
                        WeightPlacement qkv_weights) const;

  // Lays out what the block keeps for one micro-batch (Ampipe's chunked log-sum-exps and, under
  // CP, its store of every rank's key/value block on a MoE layer).
  void allocate(LayerActivations& A) const;

 private:
  RankProgram* P;
  int l;
};

// Heads' part `part` (0 q, 1 k, 2 v; or 0 k, 1 v of a key/value block) of a [s, B, Hl, n d]
// tensor, seen as [B, s, Hl, d] for the attention kernel.
inline Tensor head_view(const Tensor& t, std::int64_t d, std::int64_t part) {
  return t.slice(3, part * d, d).transpose(0, 1);
}

}  // namespace weave::graphs
