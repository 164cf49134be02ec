// A pre-norm transformer layer: x_mid = x + dropout(attention(norm1(x)) + bias), x_out = x_mid +
// dropout(mlp(norm2(x_mid)) (+ bias)), with a dense or a MoE MLP, or, for a MoE layer under
// Ampipe, the Ampipe block. The layer owns the residual connections and the MLP's norm; each
// residual end shares a task with the norm that follows it.
#pragma once

#include "model/parameter_declarer.hpp"
#include "step/rank_program.hpp"
#include "step/weight_halves.hpp"

namespace weave::graphs {

class TransformerLayer {
 public:
  TransformerLayer(RankProgram& rank, int layer) : P(&rank), l(layer) {}

  // From the layer's input in x_in (after `ready`); returns the task after which x_out is.
  TaskId forward(const BuildPosition& pos, TaskId ready) const;
  // From x_out's gradient in the workspace's d_x (after `ready`), leaving x_in's there. `last`:
  // the chunk's last backward of the step, after which the layer's buckets are reduced.
  TaskId backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves, bool last) const;

  // Lays out what the layer keeps for one micro-batch: its residual stream and MLP norm, and
  // its modules' activations. `x_in` is the previous layer's output (or the chunk's input).
  void allocate(LayerActivations& A, const Tensor& x_in) const;

  // Declares the layer's parameters into `L` as `spec` makes it: its attention's into the
  // attention bucket, then the MLP norm and its MLP's into the MLP bucket.
  static void declare_parameters(ParameterDeclarer& declare, const LayerSpec& spec, int layer,
                                 LayerShard& L);

 private:
  // The passes themselves; forward and backward bracket them with the layer's parameter gathers
  // and release under ZeRO stage 3.
  TaskId forward_pass(const BuildPosition& pos, TaskId ready) const;
  TaskId backward_pass(const BuildPosition& pos, TaskId ready, WeightHalves& halves,
                       bool last) const;
  // --recompute-modules layernorm: the pre-MLP norm's forward again from the kept x_mid (a
  // dense layer's SP gather too, and a bf16 run's rounding into fc1's input), into the rank's
  // working set, after `ready`. Returns its last task.
  TaskId mlp_norm_again(const BuildPosition& pos, TaskId ready) const;
  RankProgram* P;
  int l;
};

}  // namespace weave::graphs
