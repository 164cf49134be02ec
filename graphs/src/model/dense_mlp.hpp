// A dense layer's MLP: fc1 (column-parallel), GELU or SwiGLU, fc2 (row-parallel), and the
// reduction of fc2's partial sums over the tensor-parallel group, forward and backward.
//
// Shapes on a rank: norm [Sl, B, h] -> (SP all-gather) [Sc, B, h] -> fc1 [Sc, B, f1l] ->
// activation [Sc, B, fl] -> fc2 partial sums [Sc, B, h] -> (reduce) mlp_out [Sl, B, h].
#pragma once

#include "model/dense_mlp_parameters.hpp"
#include "model/parameter_declarer.hpp"
#include "step/rank_program.hpp"
#include "step/weight_halves.hpp"

namespace weave::graphs {

class DenseMlp {
 public:
  DenseMlp(RankProgram& rank, int layer) : P(&rank), l(layer) {}

  // From the layer's MLP norm in ln2 (after `ready`); returns the task after which mlp_out holds
  // the MLP's output (before bias and dropout).
  TaskId forward(const BuildPosition& pos, TaskId ready) const;
  // From the output's gradient in the workspace's d_mlp (after `ready`); flushes the deferred
  // weight halves of the layer above first, so they run while this one's gather moves. Returns
  // the task after which d_norm holds the gradient of the MLP's input.
  TaskId backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves) const;

  // Lays out what the MLP keeps for one micro-batch, its output included.
  void allocate(LayerActivations& A) const;

  // Declares fc1 (column-parallel) and fc2 (row-parallel) of layer `layer` into `L`.
  static void declare_parameters(ParameterDeclarer& declare, const LayerSpec& spec, int layer,
                                 DenseMlpParameters& L);

 private:
  RankProgram* P;
  int l;
};

// The MLP's computation on normed rows x [.., h], shared by training and decoding: fc1 into `fc1`
// [.., f1l], the nonlinearity into `act` [.., fl], and fc2's partial sums into `out` [.., h].
void dense_mlp_forward(const ModelConfig& m, const DenseMlpParameters& W, const Tensor& x,
                       const Tensor& fc1, const Tensor& act, const Tensor& out);

// The MLP's nonlinearity on a rank's [.., f1l] pre-activations (SwiGLU: gates, then values).
void mlp_activation_forward(const ModelConfig& m, const Tensor& pre, const Tensor& out);
void mlp_activation_backward(const ModelConfig& m, const Tensor& pre, const Tensor& d_out,
                             const Tensor& d_pre);

}  // namespace weave::graphs
