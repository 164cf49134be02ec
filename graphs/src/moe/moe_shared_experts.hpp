// Megatron-Core's shared experts (SharedExpertMLP, --moe-shared-expert-intermediate-size): one
// dense MLP, as wide as the shared experts together, that every token of a MoE layer passes
// through besides its routed experts; the MoE MLP adds its output to theirs. It is the dense MLP
// of that width without biases: fc1 column-parallel, the routed experts' activation (SwiGLU with
// --swiglu), fc2 row-parallel, and under sequence parallelism its input all-gathered and its
// partial sums reduce-scattered over the tensor-parallel group (all-reduced without sp), as
// Megatron's MLP does. Its parameters are dense ones: replicated over expert parallelism, their
// gradients reduced over the data-parallel group that holds copies of them. A 16-bit run computes
// their products as the routed experts' (expert_products.hpp): 16-bit products with fp32 sums
// into fp32 buffers holding 16-bit values, fp32 main weights and gradients.
//
// Shapes on a rank: the norm [Sl, B, h] -> (SP all-gather) [Sc, B, h] -> fc1 [Sc, B, f1 / tp] ->
// activation [Sc, B, f / tp] -> fc2 partial sums [Sc, B, h] -> (reduce) out [Sl, B, h].
#pragma once

#include "model/parameter_declarer.hpp"
#include "moe/moe_parameters.hpp"
#include "step/rank_program.hpp"
#include "step/weight_halves.hpp"

namespace weave::graphs {

class SharedExperts {
 public:
  SharedExperts(RankProgram& rank, int layer) : P(&rank), l(layer) {}

  // The forward in the stages --moe-shared-expert-overlap places apart, as Megatron-Core's
  // SharedExpertMLP splits it (pre_forward_comm, linear_fc1_forward_and_act, linear_fc2_forward
  // with post_forward_comm): the input's sp all-gather from the layer's MLP norm in ln2 (after
  // `ready`; kNoTask without sp); fc1 and the activation (after `ready` and the gather); fc2, its
  // partial sums' reduction and the gate (after fc1), returning the task after which the MoE
  // activations' shared.out holds their output. (Megatron-Core scores the gate in
  // pre_forward_comm; here it is scored after the reduction, from the same input.)
  TaskId gather_input(const BuildPosition& pos, TaskId ready) const;
  TaskId fc1_forward(const BuildPosition& pos, TaskId ready, TaskId gathered) const;
  TaskId fc2_forward(const BuildPosition& pos, TaskId fc1) const;
  // The three in a row.
  TaskId forward(const BuildPosition& pos, TaskId ready) const;

  // The backward in two stages, the mirror of the forward's: from the MLP output's gradient in
  // the workspace's d_mlp (after `ready`), through the gate, the gradient's sp all-gather and fc2
  // (its input gradient in the workspace's d_act); then (after `fc2`) the activation, fc1, the
  // input gradient's reduction and the gate's input and weight gradients, returning the task
  // after which shared_expert.d_in holds the gradient of the MLP's input through them. fc1's and
  // fc2's weight gradients are folded into their stages, or under a zero-bubble schedule's I
  // action (halves.zero_bubble()) held for its W action, as the dense MLP's are.
  TaskId fc2_backward(const BuildPosition& pos, TaskId ready, const WeightHalves& halves) const;
  TaskId fc1_backward(const BuildPosition& pos, TaskId fc2, WeightHalves& halves) const;
  // The two in a row.
  TaskId backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves) const;

  // Lays out what they keep for one micro-batch (the MoE MLP's activations laid out first).
  void allocate(LayerActivations& A) const;

  RankProgram* P;
  int l;
};

// fc1 ([f1 / tp, h], this rank's gates then values with SwiGLU) and fc2 ([h, f / tp]) of layer
// `layer`'s shared experts, named "layers.<l>.moe.shared_experts.fc{1,2}.weight".
void declare_shared_expert_parameters(ParameterDeclarer& declare, const std::string& prefix,
                                      DenseMlpParameters& W);

// --moe-shared-expert-gate: the gate's weight [1, h] of layer `layer`, replicated over tp,
// "layers.<l>.moe.shared_experts.gate_weight" (Megatron-Core's name); null without the gate.
Parameter* declare_shared_expert_gate(ParameterDeclarer& declare, const std::string& prefix);

// out [rows, h] multiplied in place by each row's gate score sigmoid(x . w) (x [rows, h] the
// rows' MLP input), the score kept in gate [rows, 1] and, when defined, out before it in ungated.
void shared_expert_gate_forward(const Tensor& w, const Tensor& x, const Tensor& out,
                                const Tensor& ungated, const Tensor& gate);

// The rank's backward workspace for them (in `workspace`, its d_mlp laid out first).
void allocate_shared_expert_workspace(RankProgram& P, BackwardWorkspace& workspace);

}  // namespace weave::graphs
