// What a rank allocates for its step: its shard, its activation and output sets (as many as the
// schedule has in flight, each layer's laid out by its modules) and the gradient workspace its
// layers share.
#include "model/output_loss.hpp"
#include "model/transformer_layer.hpp"
#include "moe/moe_expert_bias.hpp"
#include "moe/moe_shared_experts.hpp"
#include "step/rank_program.hpp"

namespace weave::graphs {

namespace {

// An activation set laid out for model chunk k's layers.
void allocate_set(RankProgram& P, ActivationSet& X, int k) {
  const StepShape& z = P.shape;
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h;
  const StageContents& holds = P.state.shard->contents();
  // Sets shared by chunks serve every one of them: the first chunk's embedding, a later
  // chunk's transfers.
  X.x_in = P.stream_activation({Sl, B, h});
  if (holds.input_embedding) X.emb_partial = z.sp() ? P.activation({Sc, B, h}) : X.x_in;
  if (P.layout.chunks() > 1) {
    X.d_send = P.stream_activation({Sl, B, h});
    X.d_recv = P.stream_activation({Sl, B, h});
  }
  Tensor x = X.x_in;
  const int first = P.layout.first_layer(k);
  X.layers.resize(static_cast<std::size_t>(P.layout.end_layer(k) - first));
  for (int l = first; l < P.layout.end_layer(k); ++l) {
    LayerActivations& A = X.layers[static_cast<std::size_t>(l - first)];
    const RecomputeGroup group = recompute_group(z.model.recompute, P.layout, l);
    if (group.empty()) {
      TransformerLayer(P, l).allocate(A, x);
    } else {
      // A recomputed layer keeps its input (the group's, or the previous layer's output in the
      // working set) and, as the group's last, its output: the next group's input.
      const std::pair<int, bool> slot{l - group.begin, z.spec(l).moe()};
      auto [at, added] = P.state.recompute_working_set.try_emplace(slot);
      LayerActivations& W = at->second;
      if (added) {
        TransformerLayer(P, l).allocate(W, Tensor{});
        W.x_out = Tensor{};  // allocated below when a layer inside a group needs it
      }
      A = W;
      A.x_in = x;
      if (l + 1 == group.end) {
        A.x_out = P.stream_activation({Sl, B, h});
      } else {
        if (!W.x_out.defined()) W.x_out = P.stream_activation({Sl, B, h});
        A.x_out = W.x_out;
      }
    }
    x = A.x_out;
  }
}

// Context parallelism's ring: key/value blocks round the cp group, forward and backward.
void allocate_ring_workspace(RankProgram& P, RingAttentionWorkspace& W) {
  const StepShape& z = P.shape;
  const std::int64_t Sc = z.Sc, B = z.B, Hl = z.Hl, d = z.d, cp = z.cp;
  for (int i = 0; i < 2; ++i) {
    W.ring[i] = P.activation({Sc, B, z.Gl, 2 * d});
    W.dring[i] = P.activation({Sc, B, z.Gl, 2 * d});
  }
  if (z.ampipe > 1) {
    W.dkv_send = P.activation({cp * Sc, B, z.Gl, 2 * d});
    W.dkv_recv = P.activation({cp * Sc, B, z.Gl, 2 * d});
    if (z.plan.ampipe_cp_resend_kv) {
      W.kv_forward = P.activation({(cp - 1) * Sc, B, z.Gl, 2 * d});
      W.kv_backward = P.activation({(cp - 1) * Sc, B, z.Gl, 2 * d});
    }
  }
  W.o_part = P.activation({z.chunk, B, Hl, d});
  W.dq_part = P.activation({z.chunk, B, Hl, d});
  W.lse_part = P.activation32({B, Hl, z.chunk});
  if (P.half()) W.merged = P.activation({Sc, B, Hl, d});
  W.ring_send.assign(static_cast<std::size_t>(cp), 0);
  W.ring_send[static_cast<std::size_t>((P.at.cp + 1) % cp)] = Sc;
  W.ring_recv.assign(static_cast<std::size_t>(cp), 0);
}

// The backward's workspace, shared by every layer of the rank: the layer's own gradients and
// each module's part, in the order they have always been laid out (the dense MLP's between the
// layer's residual and norm gradients).
void allocate_workspace(RankProgram& P, BackwardWorkspace& W, bool output_layer) {
  const StepShape& z = P.shape;
  const std::int64_t Sl = z.Sl, Sc = z.Sc, B = z.B, h = z.h, Hl = z.Hl, d = z.d;
  const bool sp = z.sp();
  W.d_x = P.stream_activation({Sl, B, h});
  W.d_x_mid = P.stream_activation({Sl, B, h});
  W.d_tmp = P.activation({Sl, B, h});
  W.d_mlp = P.activation({Sl, B, h});
  W.d_mlp_full = sp ? P.activation({Sc, B, h}) : W.d_mlp;
  // A 16-bit run's activation and fc1 gradients are the bf16 ones its products read (d_act16,
  // d_fc1_16): the activation's backward writes the latter straight.
  if (!P.half()) {
    W.dense_mlp.d_act = P.activation({Sc, B, z.fl});
    W.dense_mlp.d_fc1 = P.activation({Sc, B, z.f1l});
  }
  W.d_norm_full = P.activation({Sc, B, h});
  W.d_norm = sp ? P.activation({Sl, B, h}) : W.d_norm_full;
  if (sp && z.plan.tp_comm_overlap) {
    W.tp_overlap.gather.buffer = P.activation({Sc, B, h});
    W.tp_overlap.scatter.buffer = P.activation({Sc, B, h});
    W.tp_overlap.grad_gather.buffer = P.activation({Sc, B, h});
  }
  // A 16-bit run's attention-output gradient is the bf16 one its products read (d_attn16).
  if (!P.half()) W.attention.d_attn = P.activation({Sc, B, Hl * d});
  W.attention.d_qkv = P.activation({Sc, B, z.Gl, z.qkv_group_width()});
  if (z.cp > 1) allocate_ring_workspace(P, W.cp_ring);
  // The logits' gradient: in fp32 in an fp32 run; a 16-bit run's is the bf16 one the output
  // layer's products read (HalfWorkspace::d_logits16, counted here at 2 bytes when the step is not
  // materialized), the loss writing its fp32 values over its fp32 logits first, as Megatron-LM's
  // cross-entropy computes its gradient in place in the fp32 softmax it kept
  // (megatron/core/tensor_parallel/cross_entropy.py), the cast to bf16 making the one it returns.
  const bool sixteen_bit = z.model.precision != Precision::fp32;
  if (output_layer) {
    if (!P.half()) W.output.d_logits = P.activation({Sc * B, z.Vl});
    W.output.d_final_full = P.activation({Sc, B, h});
  }
  if (P.half()) {
    HalfWorkspace& H = W.half;
    const std::int64_t qkv = z.qkv_group_width();
    // Without SP the norms write their bf16 outputs straight (norm_forward_to_half).
    if (sp) H.norm_out = P.activation({Sl, B, h});
    if (sp) H.gathered = P.activation({Sc, B, h});
    H.qkv32 = P.activation({Sc, B, z.Gl, qkv});
    H.out16 = P.activation16({Sc, B, h});
    H.d_out16 = P.activation16({Sc, B, h});
    H.d_act16 = P.activation16({Sc, B, z.fl});
    H.d_fc1_16 = P.activation16({Sc, B, z.f1l});
    H.d_attn16 = P.activation16({Sc, B, Hl * d});
    H.d_qkv16 = P.activation16({Sc, B, z.Gl, qkv});
    if (output_layer) H.d_logits16 = P.activation16({Sc * B, z.Vl});
  }
  // A 16-bit run's output product writes bf16 logits, which the loss widens into its fp32 ones:
  // both are held at once, as Megatron-LM's .float() of the output layer's bf16 logits
  // (megatron/core/tensor_parallel/cross_entropy.py) holds them. Counted by a prediction too.
  if (output_layer && sixteen_bit) W.half.logits16 = P.activation16({Sc * B, z.Vl});
  if (z.model.has_shared_experts()) allocate_shared_expert_workspace(P, W);
  if (z.experts_reduce_under_weight_gradient()) {
    const std::int64_t rows = z.routes_replicated ? z.slot_capacity() : z.tp * z.slot_capacity();
    W.experts_d_pre = P.activation({rows, z.expert_local_f1()});
  }
}

}  // namespace

void RankProgram::allocate() {
  const StepShape& z = shape;
  if (z.model.recompute.full() && z.splits_backward)
    throw ConfigError(
        "full recomputation is not modelled with a zero-bubble schedule (its split backward keeps "
        "the output gradients of layers that recomputation would free): choose another "
        "--pipeline-scheduler, or --recompute-granularity selective");
  RankState& R = state;
  const int pp = at.pp;
  const StageContents contents = layout.contents(pp);
  R.shard = std::make_unique<ModelShard>(z.model, mesh, rank, device, contents, materialize);
  const auto& chunks = set_plan.set_chunks[static_cast<std::size_t>(pp)];
  R.sets.resize(chunks.size());
  MemoryRecording* recording = active_memory_recording();
  for (std::size_t i = 0; i < R.sets.size(); ++i) {
    if (recording) {
      recording->rank = rank;
      recording->set = static_cast<int>(i);
    }
    allocate_set(*this, R.sets[i], chunks[i]);
  }
  if (recording) recording->set = -1;
  R.outputs.resize(static_cast<std::size_t>(set_plan.output_sets[static_cast<std::size_t>(pp)]));
  for (OutputSet& O : R.outputs)
    OutputLoss(*this).allocate(O);
  R.norm_sq = activation({1});
  if (opt.loss_scaling) R.found_inf = activation({1});
  if (uses_expert_bias(z.model))
    for (int l = 0; l < z.model.num_layers; ++l)
      if (R.shard->holds_layer(l) && R.shard->layer(l).moe())
        R.expert_loads[l] = activation({z.model.num_experts});
  R.loss.assign(static_cast<std::size_t>(z.M), 0.0);
  R.aux.assign(static_cast<std::size_t>(z.M), 0.0);
  allocate_workspace(*this, R.ws, contents.output_layer);
}

}  // namespace weave::graphs
