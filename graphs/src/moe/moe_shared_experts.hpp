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

namespace weave::graphs {

class SharedExperts {
 public:
  SharedExperts(RankProgram& rank, int layer) : P(&rank), l(layer) {}

  // From the layer's MLP norm in ln2 (after `ready`); returns the task after which the MoE
  // activations' shared.out holds the shared experts' output.
  TaskId forward(const BuildPosition& pos, TaskId ready) const;
  // From the MLP output's gradient in the workspace's d_mlp (after `ready`), its weights'
  // gradients accumulated; returns the task after which shared_expert.d_in holds the gradient of
  // the MLP's input through them.
  TaskId backward(const BuildPosition& pos, TaskId ready) const;

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
