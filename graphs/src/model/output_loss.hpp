// The model's end: the final norm, the output layer (the word embedding, tied) and the vocab-
// parallel cross-entropy, whose row maxima and partial sums are reduced over the tensor-parallel
// group. Shapes on a rank: x [Sl, B, h] -> norm -> (SP all-gather) [Sc, B, h] -> logits
// [Sc B, Vl] -> loss (the micro-batch's share of the global batch's mean).
#pragma once

#include "model/output_loss_parameters.hpp"
#include "model/parameter_declarer.hpp"
#include "step/rank_program.hpp"
#include "step/weight_halves.hpp"

namespace weave::graphs {

class OutputLoss {
 public:
  explicit OutputLoss(RankProgram& rank) : P(&rank) {}

  // From the last layer's x_out (after `ready`); the loss lands in the rank's state.
  TaskId forward(const BuildPosition& pos, TaskId ready) const;
  // The gradient of the last layer's output into the workspace's d_x; the output layer's weight
  // half placed right after (running while the input gradient is reduced) or kept for W.
  TaskId backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves) const;

  // Lays out one micro-batch's loss buffers.
  void allocate(OutputSet& O) const;

  // Declares the final norm (its own bucket) and, untied, the output layer's weight (the output
  // bucket), held by the last stage (`contents`).
  static void declare_parameters(ParameterDeclarer& declare, const StageContents& contents,
                                 OutputLossParameters& O);

 private:
  RankProgram* P;
};

}  // namespace weave::graphs
