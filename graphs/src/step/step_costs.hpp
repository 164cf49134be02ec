// The virtual clock's price of the step's compute: the multiply-adds (x2) of the matrix products
// and attention each task runs, from the shapes it multiplies (with the products' edges and the
// attention's share, so a kernel model can price them apart); element-wise work (norms,
// residuals, dropout, copies, the optimizer) by the bytes of the elements it reads and writes,
// which the machine model prices at the device's memory bandwidth. Each hint counts the kernels
// it stands for in `messages` (one a product, attention kernel or streaming pass; summed as
// hints are, kept when one is scaled: a share of a batched kernel is still one launch), which
// the kernel model prices at a fixed cost each.
#pragma once

#include <algorithm>
#include <cstdint>

#include "config/step_shape.hpp"
#include "weave/runtime/types.hpp"

namespace weave::graphs::cost {

// A memory-bound task that reads and writes `elements` activations in all, each of the training
// precision's bytes (ModelConfig::activation_bytes).
inline rt::CostHint streamed(const StepShape& z, double elements) {
  return {.bytes = z.model.activation_bytes() * elements, .messages = 1};
}
// The same over values of `element_bytes` each, whatever the precision: the gradients and the
// optimizer's fp32 state.
inline rt::CostHint streamed_bytes(double elements, double element_bytes) {
  return {.bytes = element_bytes * elements, .messages = 1};
}

// The rows a MoE slot's experts take on a rank when routing is balanced: its tokens' top-k
// picks (a hint is fixed when the graph is built; dropless counts vary from step to step).
inline double routed_rows(const StepShape& z) {
  return static_cast<double>(z.slot_tokens()) * z.model.moe_router_topk;
}
// Regrouping a slot's rows (read and write each).
inline double regrouped_elements(const StepShape& z) {
  return 2 * routed_rows(z) * static_cast<double>(z.h);
}
// The combine: every picked row read with its weight, every token's output written.
inline double combine_elements(const StepShape& z) {
  return (routed_rows(z) + static_cast<double>(z.slot_tokens())) * static_cast<double>(z.h);
}

// The router's work beyond its product, by the elements it streams, one pass each: the slot's
// tokens copied into the layer's MoE input (read and written; Megatron-Core's router takes a
// view), the scores' pass over the [tokens, E] logits (read, the probabilities written), and
// the permutation of every pick's row into expert order (each row read and written, as
// Megatron-Core's permute gathers them with index_select; framed for the all-to-all alike).
inline rt::CostHint routing(const StepShape& z) {
  const double n = static_cast<double>(z.slot_tokens()), h = static_cast<double>(z.h);
  const double e = static_cast<double>(z.model.num_experts);
  return streamed(z, 2 * n * h) + streamed(z, 2 * n * e) + streamed(z, regrouped_elements(z));
}
// Its backward beyond the router's two products: the picks' gradient rows summed back into
// their tokens' rows (each pick's row read, each token's row written: the backward of
// Megatron-Core's permute, a scatter-add), the scores' backward over the logits (the probabilities
// and their gradient read, the logits' gradient written) and the router's own input gradient added
// into the tokens' (two read, one written). With --use-pipe-experts or the tp-sp overlap the
// items' gradient rows are copied into the slot's rows first (read and written).
inline rt::CostHint routing_backward(const StepShape& z) {
  const double n = static_cast<double>(z.slot_tokens()), h = static_cast<double>(z.h);
  const double e = static_cast<double>(z.model.num_experts);
  rt::CostHint cost =
      streamed(z, (routed_rows(z) + n) * h) + streamed(z, 3 * n * e) + streamed(z, 3 * n * h);
  if (z.expert_items()) cost = cost + streamed(z, regrouped_elements(z));
  return cost;
}
// Expert parallelism's regrouping around the local experts (ep > 1): the rows that arrived,
// grouped by source, copied into expert order before the experts' products and their results
// copied back into source order after them (each row read and written, twice), as
// Megatron-Core's sort_chunks_by_idxs permutes them when a rank holds several experts (weave's
// task copies with one too). Their gradients take the same two copies backward.
inline rt::CostHint expert_regrouping(const StepShape& z) {
  return streamed(z, regrouped_elements(z)) + streamed(z, regrouped_elements(z));
}
// With --use-pipe-experts or the tp-sp overlap the combine first copies the items' returned rows
// into the slot's rows (read and written), and its backward copies the gradient rows out to the
// items; the combine itself then runs as the slot's.
inline rt::CostHint combine(const StepShape& z) {
  const rt::CostHint combine = streamed(z, combine_elements(z));
  return z.expert_items() ? combine + streamed(z, regrouped_elements(z)) : combine;
}
inline rt::CostHint combine_backward(const StepShape& z) {
  const rt::CostHint combine = streamed(z, 2 * combine_elements(z));
  return z.expert_items() ? combine + streamed(z, regrouped_elements(z)) : combine;
}

// 2 (mn + nk + mk) of an [m, k] x [k, n] product: what its overhead grows with when a
// dimension is small (rt::CostHint::matmul_edges). The same for the product's transposes, so a
// backward's two products have the forward's.
inline double matmul_edges(double rows, double in, double out) {
  return 2 * (rows * in + in * out + rows * out);
}

// The loss over a rank's [rows, V/t] logits, as Megatron-Core runs it (CrossEntropyFusion).
// Unfused (megatron/core/tensor_parallel/cross_entropy.py, the default without
// --cross-entropy-loss-fusion): every step one kernel over the whole fp32 tensor, so a small
// model's loss at a 131,072 vocabulary streams gigabytes a micro-batch. Under bf16/fp16 the logits
// are widened to fp32 first (.float(): 2 bytes read, 4 written) and the gradient narrowed back for
// the output layer's products (4 read, 2 written). Native (megatron/core/fusions/
// fused_cross_entropy.py): the same steps in four jit-fused functions, one pass each. te
// (Transformer Engine's parallel_cross_entropy, transformer_engine/pytorch/triton/
// cross_entropy.py, the version of 2025): an online softmax reads the logits in their own
// precision for the rows' maxima and sums, a second kernel reads them again and writes the
// gradient in their place, and the backward scales it in place by the per-token loss gradient.
inline double logits_elements(const StepShape& z) {
  return static_cast<double>(z.Sc * z.B) * static_cast<double>(z.Vl);
}
inline bool widens_logits(const StepShape& z) {
  return z.model.activation_bytes() < 4;
}
// Forward, before the maxima's all-reduce: unfused the widening and the row maxima (4 bytes
// read); native both in one pass (the logits read, the fp32 copy written); te the online
// softmax's read of the logits.
inline rt::CostHint cross_entropy_maxima(const StepShape& z) {
  const double n = logits_elements(z), a = z.model.activation_bytes();
  switch (z.model.cross_entropy_fusion) {
    case CrossEntropyFusion::te:
      return streamed_bytes(n, a);
    case CrossEntropyFusion::native:
      return streamed_bytes(n, widens_logits(z) ? a + 4 : 4);
    case CrossEntropyFusion::unfused:
      break;
  }
  const rt::CostHint maxima = streamed_bytes(n, 4);
  return widens_logits(z) ? streamed_bytes(n, 2 + 4) + maxima : maxima;
}
// Between the two all-reduces: unfused the maxima subtracted in place (4 + 4), exp in place
// (4 + 4) and the row sums (4); native the three in one pass (4 + 4); te the second kernel, which
// reads the logits and writes the gradient over them.
inline rt::CostHint cross_entropy_exp_sums(const StepShape& z) {
  const double n = logits_elements(z), a = z.model.activation_bytes();
  switch (z.model.cross_entropy_fusion) {
    case CrossEntropyFusion::te:
      return streamed_bytes(n, 2 * a);
    case CrossEntropyFusion::native:
      return streamed_bytes(n, 8);
    case CrossEntropyFusion::unfused:
      break;
  }
  return streamed_bytes(n, 8) + streamed_bytes(n, 8) + streamed_bytes(n, 4);
}
// After the sums' all-reduce: the softmax kept for the backward, exp divided by the sums in place
// (4 + 4), unfused and native alike; te has nothing left to do over the logits.
inline rt::CostHint cross_entropy_softmax(const StepShape& z) {
  if (z.model.cross_entropy_fusion == CrossEntropyFusion::te) return {};
  return streamed_bytes(logits_elements(z), 8);
}
// Backward: unfused the softmax minus the one-hot targets (one element a row), scaled by the
// loss's gradient in place (4 + 4), narrowed for the products under bf16/fp16 (4 + 2); native
// the three in one pass, which narrows to bf16 whatever the precision (4 + 2); te the gradient
// scaled in place in the logits' precision (Megatron-Core's loss gradient is per token, so
// Transformer Engine's skip for a gradient of 1.0 does not apply).
inline rt::CostHint cross_entropy_backward(const StepShape& z) {
  const double n = logits_elements(z), a = z.model.activation_bytes();
  switch (z.model.cross_entropy_fusion) {
    case CrossEntropyFusion::te:
      return streamed_bytes(n, 2 * a);
    case CrossEntropyFusion::native:
      return streamed_bytes(n, 4 + 2);
    case CrossEntropyFusion::unfused:
      break;
  }
  const rt::CostHint scaled = streamed_bytes(n, 8);
  return widens_logits(z) ? scaled + streamed_bytes(n, 4 + 2) : scaled;
}

// What Megatron-Core runs over a gradient bucket on the compute stream before its data-parallel
// collective (start_grad_sync in megatron/core/distributed/param_and_grad_buffer.py, lines
// 111-123 at core_v0.8.0, the release the Megatron-LM README's H100 table was measured with;
// check_grads and the same scaling at lines 345-352 and 655-667 of 2026's main): with
// check_for_nan_in_grad (--check-for-nan-in-loss-and-grad, on by default; arguments.py turns it
// off under dynamic loss scaling) the bucket's norm, one read of every gradient, and, the
// replicas' average being taken before a summing collective (gradient_scaling_factor = 1 /
// replicas in distributed_data_parallel.py, without --ddp-average-in-collective), the bucket
// scaled in place, a read and a write. Each is one kernel over `elements` of `element_bytes`.
inline rt::CostHint pre_reduction_passes(double elements, double element_bytes, bool checked,
                                         int replicas) {
  rt::CostHint cost{};
  if (checked) cost = cost + streamed_bytes(elements, element_bytes);
  if (replicas > 1) cost = cost + streamed_bytes(elements, 2 * element_bytes);
  return cost;
}

// The word embedding's weight gradient as Megatron-Core takes it, whatever few rows the tokens
// touch: F.embedding's backward writes a dense [V/t, h] gradient in the weight's precision
// (VocabParallelEmbedding, megatron/core/tensor_parallel/layers.py), and the data-parallel
// wrapper's gradient hook adds it into the fp32 main gradient (param.main_grad.add_(param.grad)
// in megatron/core/distributed/distributed_data_parallel.py: the embedding is no layer whose
// weight-gradient product accumulates into main_grad itself), reading both and writing the sum:
// every micro-batch, a + (a + 4 + 4) bytes an element.
inline rt::CostHint embedding_weight_gradient(const StepShape& z) {
  const double n = static_cast<double>(z.Vl) * static_cast<double>(z.h);
  const double a = z.model.activation_bytes();
  return streamed_bytes(n, a) + streamed_bytes(n, a + 4 + 4);
}

// A [rows, in] x [in, out] product.
inline rt::CostHint matmul(std::int64_t rows, std::int64_t in, std::int64_t out) {
  const double r = static_cast<double>(rows), i = static_cast<double>(in),
               o = static_cast<double>(out);
  return {.flops = 2.0 * r * i * o,
          .messages = 1,
          .matmul_edges = static_cast<float>(matmul_edges(r, i, o))};
}

// A dense MLP's two products over `rows`: [rows, h] x [h, f1] then [rows, f] x [f, h].
inline rt::CostHint mlp(const StepShape& z, std::int64_t rows) {
  const double r = static_cast<double>(rows), h = static_cast<double>(z.h);
  return {.flops = 2.0 * r * h * static_cast<double>(z.f1l + z.fl),
          .messages = 2,
          .matmul_edges = static_cast<float>(matmul_edges(r, h, static_cast<double>(z.f1l)) +
                                             matmul_edges(r, static_cast<double>(z.fl), h))};
}

// The dense MLP's activation between its two products, over `rows`, as Megatron-Core's MLP runs
// it (megatron/core/transformer/mlp.py; fc1 returns its bias apart, skip_bias_add): one fused
// element-wise kernel (bias_gelu_impl, megatron/core/fusions/fused_bias_gelu.py, or
// bias_swiglu_impl under SwiGLU; the unfused path streams the same tensors) that reads fc1's
// output (f1 wide: 2f when gated) and writes the activation (f wide).
inline rt::CostHint mlp_activation(const StepShape& z, std::int64_t rows) {
  return streamed(z, static_cast<double>(rows) * static_cast<double>(z.f1l + z.fl));
}

// Its backward: reads the activation's gradient and fc1's output and writes fc1's output
// gradient. With a bias, GeLUFunction.backward returns that gradient for the bias as well, which
// autograd sums over the rows (one more read of it, a kernel of its own).
inline rt::CostHint mlp_activation_backward(const StepShape& z, std::int64_t rows) {
  const double r = static_cast<double>(rows);
  const rt::CostHint pass = streamed(z, r * static_cast<double>(z.fl + 2 * z.f1l));
  return z.model.add_bias_linear ? pass + streamed(z, r * static_cast<double>(z.f1l)) : pass;
}

// Causal attention of a rank's Sc query rows (B sequences, Hl heads) against the whole
// sequence's keys: the scores and the weighted values, over half of the (query, key) pairs on
// average.
inline rt::CostHint causal_attention(const StepShape& z) {
  const double flops = 2 * 2 * static_cast<double>(z.B * z.Hl * z.Sc) *
                       static_cast<double>(z.S / z.cp * z.cp) * static_cast<double>(z.d) * 0.5;
  return {.flops = flops, .messages = 1, .attention_flops = static_cast<float>(flops)};
}

// Attention backward: five products against forward's two.
inline rt::CostHint causal_attention_backward(const StepShape& z) {
  return 2.5 * causal_attention(z);
}

// Megatron's materialised core attention (--attention-backend unfused or local) of a rank's Sc
// query rows (B sequences, Hl heads) against the sequence's S keys: QK^T and the product with V
// as B Hl batched products each over the whole S x S square (baddbmm and bmm compute the masked
// half too), priced as products of their shapes ([Sc, d] x [d, S] and [Sc, S] x [S, d]: the
// small inner dimension d makes their edges, the scores they write and read, count).
inline rt::CostHint materialised_attention_products(const StepShape& z) {
  const double batches = static_cast<double>(z.B * z.Hl);
  return batches * (matmul(z.Sc, z.d, z.S) + matmul(z.Sc, z.S, z.d));
}

// The scores' element-wise passes in the forward, by their memory traffic: the fused
// scale-mask-softmax reads the scores and writes the probabilities, and with attention dropout
// the dropout reads them and writes its output and its one-byte mask.
inline rt::CostHint materialised_scores_forward(const StepShape& z) {
  const double scores = static_cast<double>(z.B * z.Hl * z.Sc) * static_cast<double>(z.S);
  const double a = z.model.activation_bytes();
  const double dropout = z.model.attention_dropout > 0 ? 2 * a + 1 : 0;
  return {.bytes = scores * (2 * a + dropout), .messages = dropout > 0 ? 2u : 1u};
}

// Their backward: the dropout's reads the gradient and the mask and writes the gradient; the
// softmax's reads the probabilities and the gradient and writes the gradient.
inline rt::CostHint materialised_scores_backward(const StepShape& z) {
  const double scores = static_cast<double>(z.B * z.Hl * z.Sc) * static_cast<double>(z.S);
  const double a = z.model.activation_bytes();
  const double dropout = z.model.attention_dropout > 0 ? 2 * a + 1 : 0;
  return {.bytes = scores * (3 * a + dropout), .messages = dropout > 0 ? 2u : 1u};
}

// The core attention's forward as the backend prices it: the fused kernel's causal half, or the
// materialised scores' products and passes.
inline rt::CostHint core_attention(const StepShape& z) {
  return z.model.materialised_scores()
             ? materialised_attention_products(z) + materialised_scores_forward(z)
             : causal_attention(z);
}

// Its backward: the fused kernel's five products of the causal half (it recomputes the scores);
// the materialised scores' four products (dV, dP, dQ, dK: twice the forward's) and backward
// passes, with the forward again first when selective recomputation recomputes the core
// attention (its scores were not kept).
inline rt::CostHint core_attention_backward(const StepShape& z) {
  if (!z.model.materialised_scores()) return causal_attention_backward(z);
  const rt::CostHint products = materialised_attention_products(z);
  const rt::CostHint backward = products + products + materialised_scores_backward(z);
  return z.model.recompute.recomputes(kRecomputeCoreAttention) ? core_attention(z) + backward
                                                               : backward;
}

// The share of the causal attention's (query, key) pairs that Ampipe chunk c's queries take: a
// piece of q queries from sequence row `first` sees q (2 first + q) / Sc^2 of them.
inline double ampipe_causal_share(const StepShape& z, int c) {
  double share = 0;
  for (int j = 0; j < z.t_sp; ++j) {
    const double q = static_cast<double>(z.piece_rows());
    const double first = static_cast<double>(z.piece_start(c, j));
    share += q * (2 * first + q) / (static_cast<double>(z.Sc) * static_cast<double>(z.Sc));
  }
  return share;
}

// The attention's output projection of the rank's Sc rows: [Sc B, Hl d] x [Hl d, h].
inline rt::CostHint projection(const StepShape& z) {
  return matmul(z.Sc * z.B, z.Hl * z.d, z.h);
}

// The QKV projection: [Sc B, h] x [h, (Hl + 2 Gl) d] (3 Hl d without grouped-query attention).
inline rt::CostHint qkv(const StepShape& z) {
  return matmul(z.Sc * z.B, z.h, z.qkv_width());
}

// The experts' two products over a slot's expected rows (its tokens' top-k picks, balanced),
// for `tokens` routed tokens: each local expert multiplies its share of the rows.
inline rt::CostHint experts(const StepShape& z, double tokens) {
  const double rows = tokens * static_cast<double>(z.model.moe_router_topk);
  // Split experts run every tp rank's rows on the rank's share of the hidden layer, the slot's
  // tokens' whole products; routed replicated the rows are the slot's own, on the share alone.
  const double share = z.routes_replicated ? static_cast<double>(z.etp) : 1.0;
  const double h = static_cast<double>(z.h), f1 = static_cast<double>(z.expert_f1()) / share,
               f = static_cast<double>(z.fe) / share;
  const double experts = static_cast<double>(std::max<std::int64_t>(z.local_experts(), 1));
  const double per_expert = rows / experts;
  return {.flops = 2 * tokens * static_cast<double>(z.model.moe_router_topk) * h * (f1 + f),
          .messages = static_cast<std::uint32_t>(2 * experts),
          .matmul_edges = static_cast<float>(
              experts * (matmul_edges(per_expert, h, f1) + matmul_edges(per_expert, f, h)))};
}

// The experts' activation over a slot's expected rows (as experts() counts them): one
// element-wise pass reading their first product (f1 wide) and writing the hidden layer (f
// wide), which --recompute-modules moe_act runs again before fc2's weight gradient.
inline rt::CostHint expert_activation(const StepShape& z, double tokens) {
  const double rows = tokens * static_cast<double>(z.model.moe_router_topk);
  const double share = z.routes_replicated ? static_cast<double>(z.etp) : 1.0;
  return streamed(z, rows * static_cast<double>(z.expert_f1() + z.fe) / share);
}

// One item of a slot's experts (pipe experts, Ampipe's tp-sp overlap): one local expert's rows
// in `slices` capacity slices, so its products are that much skinnier.
inline rt::CostHint expert_item(const StepShape& z, double tokens, std::int64_t slices) {
  const double items = static_cast<double>(z.local_experts() * slices);
  const double rows = tokens * static_cast<double>(z.model.moe_router_topk) / items;
  const double share = z.routes_replicated ? static_cast<double>(z.etp) : 1.0;  // as experts()
  const double h = static_cast<double>(z.h), f1 = static_cast<double>(z.expert_f1()) / share,
               f = static_cast<double>(z.fe) / share;
  return {.flops = experts(z, tokens).flops / items,
          .messages = 2,
          .matmul_edges = static_cast<float>(matmul_edges(rows, h, f1) + matmul_edges(rows, f, h))};
}

// The router's logits: [tokens, h] x [h, E].
inline rt::CostHint router(const StepShape& z, double tokens) {
  const double h = static_cast<double>(z.h), e = static_cast<double>(z.model.num_experts);
  return {.flops = 2 * tokens * h * e,
          .messages = 1,
          .matmul_edges = static_cast<float>(matmul_edges(tokens, h, e))};
}

// MindSpeed's deepspeed_moe gate without --enable-token-rearrange-opt dispatches and combines by
// dense einsums over a gate call's one-hot [s, E, C] tensors (mindspeed/moe/moe_layer.py; under
// Ampipe ampipe_moe_gating_computer.py and ampipe_post_mlp_computer.py, per chunk): the dispatch
// "sec,sm->ecm" is an [E C, s] x [s, h] product, the combine "sec,ecm->sm" an [s, E C] x [E C, h]
// one, whatever few of their terms are nonzero. Backward the dispatch's input gradient (its mask
// takes none) and the combine's two, the experts' outputs' and the gate weights'. C is the gate
// call's capacity (balanced picks when dropless); s the slot's tokens.
inline bool dense_einsum_dispatch(const StepShape& z) {
  return z.model.num_experts > 0 && z.model.moe_gate == MoeGate::deepspeed &&
         !z.model.moe_token_rearrange;
}
inline std::int64_t gate_buffer_rows(const StepShape& z) {  // E C
  const std::int64_t e = z.model.num_experts, s = z.slot_tokens(), k = z.model.moe_router_topk;
  const std::int64_t c = z.expert_capacity() > 0 ? z.expert_capacity() : (s * k + e - 1) / e;
  return e * c;
}
inline rt::CostHint einsum_dispatch(const StepShape& z) {
  if (!dense_einsum_dispatch(z)) return {};
  return matmul(gate_buffer_rows(z), z.slot_tokens(), z.h);
}
inline rt::CostHint einsum_dispatch_backward(const StepShape& z) {
  if (!dense_einsum_dispatch(z)) return {};
  return matmul(z.slot_tokens(), gate_buffer_rows(z), z.h);
}
inline rt::CostHint einsum_combine(const StepShape& z) {
  if (!dense_einsum_dispatch(z)) return {};
  return matmul(z.slot_tokens(), gate_buffer_rows(z), z.h);
}
inline rt::CostHint einsum_combine_backward(const StepShape& z) {
  if (!dense_einsum_dispatch(z)) return {};
  return matmul(gate_buffer_rows(z), z.slot_tokens(), z.h) +
         matmul(z.slot_tokens(), z.h, gate_buffer_rows(z));
}

}  // namespace weave::graphs::cost
