// The shape of a GPT-style decoder with optional Mixture-of-Experts layers, named as
// Megatron-LM's arguments are.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weave::graphs {

enum class Activation { gelu, swiglu };
// --position-embedding-type: a learned table added to the word embedding, rotary embeddings
// applied to queries and keys in every layer, or none (Megatron-Core's "none").
enum class PositionEmbedding { learned_absolute, rope, none };
// --normalization: LayerNorm (weight and bias) or RMSNorm (weight only).
enum class Normalization { layer_norm, rms_norm };

// "learned_absolute", "rope" or "none", as the flag spells them.
const char* position_embedding_name(PositionEmbedding p);

// --attention-backend: Megatron-Core's AttnBackend, the kernel the core attention runs. flash and
// fused (FlashAttention's and cuDNN's fused kernels) and auto (Transformer Engine's choice among
// them) never hold the s x s scores; unfused (Transformer Engine's) and local (Megatron-Core's own
// DotProductAttention, the core attention of Megatron-LM's 2021-2022 releases) materialise them:
// QK^T and the product with V as batched matrix products over the whole square, a fused
// scale-mask-softmax and the dropout on the scores as element-wise passes over s^2 values, and
// the softmax's output, the dropout's mask and its output kept for the backward. weave's own
// kernel computes the same attention either way; the backend sets how the step is priced and
// what it holds.
enum class AttentionBackend { flash, fused, unfused, local, automatic };
// "flash", "fused", "unfused", "local" or "auto", as the flag spells them.
const char* attention_backend_name(AttentionBackend b);

// --cross-entropy-loss-fusion with --cross-entropy-fusion-impl: how Megatron-Core runs the loss
// over the vocabulary (compute_language_model_loss in
// megatron/core/models/common/language_module/language_module.py). unfused: its vocab-parallel
// cross-entropy, one kernel a step over fp32 logits (the default); native: the same steps grouped
// into jit-fused functions (megatron/core/fusions/fused_cross_entropy.py); te: Transformer Engine's
// online-softmax kernels over the logits in their own precision. weave computes the same loss
// either way; the choice sets the passes' memory traffic (step_costs.hpp).
enum class CrossEntropyFusion { unfused, native, te };
// "unfused", "native" or "te".
const char* cross_entropy_fusion_name(CrossEntropyFusion f);

// The precision a run trains in (--bf16, --fp16; fp32 without either). weave's kernels compute in
// fp32, so a step built with tensors is fp32; a prediction (built without tensors) counts the
// bytes a half-precision run holds and moves, as Megatron-LM keeps them.
enum class Precision { fp32, bf16, fp16 };

// The rule a MoE layer routes its tokens by.
enum class MoeGate {
  // Megatron-Core's TopKRouter: top-k of the softmax, weights renormalised over the k picks,
  // capacity (if any) from --moe-expert-capacity-factor over the micro-batch's picks in token
  // order, the load-balancing and z losses over the whole micro-batch's statistics.
  megatron,
  // MindSpeed's deepspeed_moe gate (top-1 or top-2): capacity per gate call (per rank and Ampipe
  // chunk) from --moe-train-capacity-factor with a minimum of 4, first choices before second
  // choices, weights after the drops, and top-2's load-balancing loss over the call's own tokens.
  deepspeed,
};

// Megatron-Core's --moe-router-load-balancing-type with MoeGate::megatron (its "none" is aux_loss
// with a coefficient of 0).
enum class MoeLoadBalancing {
  // The load-balancing loss of the micro-batch's tokens together.
  aux_loss,
  // The loss of each sequence of the micro-batch over its own tokens, averaged over the sequences
  // (DeepSeek-V2/V3's sequence-wise loss).
  seq_aux_loss,
  // S-BASE's Sinkhorn routing: in training each token picks the top-k of the logits of all the
  // tokens its rank routes, Sinkhorn-balanced; its weights are the picks' softmax scores (top-1's
  // sigmoid), not renormalised. No load-balancing loss.
  sinkhorn,
};
// "fp32", "bf16" or "fp16".
const char* precision_name(Precision p);

// Bytes per parameter in each memory category, as Megatron-LM's distributed optimizer keeps them
// (Megatron Core's developer guide, "Distributed Optimizer": 16 bytes for fp32 parameters and
// gradients, 8 + 8/d with the distributed optimizer; 18 for 16-bit parameters with fp32
// gradients, 6 + 12/d). The optimizer state is what the distributed optimizer shards over the d
// replicas: Adam's two moments, plus an fp32 master copy of the weights when they are 16-bit.
// Both 16-bit formats accumulate and reduce their gradients in fp32, as Megatron-LM does with
// --accumulate-allreduce-grads-in-fp32 (which it turns on with --bf16; with --fp16 its default
// is fp16 gradients and an fp32 copy of the shard in the optimizer, 20 bytes, 4 + 16/d), as the
// trained step does.
struct ParameterBytes {
  int parameter;        // the model's weights
  int gradient;         // the gradient buffer the backward accumulates into and the replicas reduce
  int optimizer_state;  // per parameter of the shard the optimizer updates
};
ParameterBytes parameter_bytes(Precision p);

// --recompute-granularity: Megatron-LM's activation recomputation. full: a recomputed layer keeps
// only its input and runs its forward again before its backward; selective: the modules
// --recompute-modules names are (by default the core attention, the softmax of the scores).
enum class RecomputeGranularity { none, full, selective };
// --recompute-method for full recomputation: uniform splits each model chunk's layers into groups
// of --recompute-num-layers, each keeping only the group's input; block recomputes the first
// --recompute-num-layers layers of each model chunk one by one and keeps the rest.
enum class RecomputeMethod { none, uniform, block };

// --recompute-modules for selective recomputation: Megatron-Core's names (TransformerConfig's
// recompute_modules), one bit each.
enum RecomputeModule : unsigned {
  kRecomputeCoreAttention = 1u << 0,  // core_attn
  kRecomputeMlp = 1u << 1,            // mlp: the dense MLP
  kRecomputeMoe = 1u << 2,            // moe
  kRecomputeMoeActivation = 1u << 3,  // moe_act
  kRecomputeLayerNorm = 1u << 4,      // layernorm
};

struct Recompute {
  RecomputeGranularity granularity = RecomputeGranularity::none;
  RecomputeMethod method = RecomputeMethod::none;
  int num_layers = 0;  // --recompute-num-layers; 0: not given
  // RecomputeModule bits; 0: Megatron-Core's default, core_attn alone.
  unsigned modules = 0;
  bool full() const { return granularity == RecomputeGranularity::full; }
  // Whether selective recomputation recomputes `module`.
  bool recomputes(RecomputeModule module) const {
    const unsigned chosen = modules != 0 ? modules : kRecomputeCoreAttention;
    return granularity == RecomputeGranularity::selective && (chosen & module) != 0;
  }
};

struct ModelConfig {
  int num_layers = 2;                      // --num-layers
  int hidden_size = 64;                    // --hidden-size
  int num_attention_heads = 4;             // --num-attention-heads
  int ffn_hidden_size = 256;               // --ffn-hidden-size: the dense MLPs' hidden size
  int seq_length = 64;                     // --seq-length
  int max_position_embeddings = 0;         // --max-position-embeddings; 0: seq_length
  int vocab_size = 256;                    // the tokenizer's (byte-level: 256)
  int make_vocab_size_divisible_by = 128;  // padded so every tensor-parallel shard is equal
  Activation activation = Activation::gelu;
  PositionEmbedding position_embedding = PositionEmbedding::learned_absolute;
  double rotary_percent = 1.0;  // --rotary-percent: the share of each head's dims rotated
  double rotary_base = 10000;   // --rotary-base: theta_i = base^(-2i / rotary dims)
  Normalization normalization = Normalization::layer_norm;
  double layernorm_epsilon = 1e-5;  // --norm-epsilon (--layernorm-epsilon)
  // --qk-layernorm: each head's queries and keys normed (LayerNorm or RMSNorm as above, over the
  // head's dimensions) after the QKV projection and before the rotary embedding.
  bool qk_layernorm = false;
  // --num-query-groups with --group-query-attention: key/value heads, each shared by
  // num_attention_heads / num_query_groups query heads; 0: one per query head.
  int num_query_groups = 0;
  // --kv-channels: each attention head's width, Megatron-LM's kv_channels; 0: --hidden-size /
  // --num-attention-heads, Megatron-LM's default. The QKV projection maps h to heads x kv_channels
  // queries and groups x kv_channels keys and values, the output projection heads x kv_channels
  // back to h (Megatron-Core's query_projection_size and kv_projection_size), so the attention's
  // context may be wider or narrower than h.
  int kv_channels = 0;
  bool untie_embeddings_and_output_weights = false;  // an output layer of its own
  bool add_bias_linear = true;                       // false: --disable-bias-linear
  double attention_dropout = 0.0;                    // --attention-dropout, on the probabilities
  AttentionBackend attention_backend = AttentionBackend::flash;  // --attention-backend
  double hidden_dropout = 0.0;                                   // --hidden-dropout
  double init_method_std = 0.02;                                 // --init-method-std
  // --cross-entropy-loss-fusion and --cross-entropy-fusion-impl
  CrossEntropyFusion cross_entropy_fusion = CrossEntropyFusion::unfused;

  // Mixture of Experts
  int num_experts = 0;     // --num-experts; 0: dense MLPs everywhere
  int moe_layer_freq = 1;  // --moe-layer-freq N: every N-th layer is MoE (from layer 0)
  // --moe-layer-freq as Megatron-Core's list (moe_layer_freq.hpp): one entry per layer, 1 for a
  // MoE layer and 0 for a dense one; empty: every moe_layer_freq-th layer.
  std::vector<int> moe_layer_pattern;
  // --moe-ffn-hidden-size: each routed expert's hidden size; 0: --ffn-hidden-size, as
  // Megatron-Core defaults it.
  int moe_ffn_hidden_size = 0;
  // --moe-shared-expert-intermediate-size: Megatron-Core's shared experts, one dense MLP this wide
  // (the shared experts' widths summed) that every token of a MoE layer passes through besides
  // its routed experts; 0: none.
  int moe_shared_expert_intermediate_size = 0;
  // --moe-shared-expert-overlap: the shared experts run while the dispatcher's all-to-alls are in
  // flight instead of before the router: fc1 under the dispatch, fc2 under the combine.
  bool moe_shared_expert_overlap = false;
  // --moe-shared-expert-gate: the shared experts' output multiplied by each token's
  // sigmoid(w . x), w a [h] weight of the layer replicated over tp (Megatron-Core's SharedExpertMLP
  // gate, Qwen2-MoE's shared-expert gate).
  bool moe_shared_expert_gate = false;
  int moe_router_topk = 2;                  // --moe-router-topk
  double moe_aux_loss_coeff = 0.0;          // --moe-aux-loss-coeff
  double moe_z_loss_coeff = 0.0;            // --moe-z-loss-coeff
  double moe_expert_capacity_factor = 0.0;  // --moe-expert-capacity-factor; 0: dropless
  bool moe_router_renormalize = true;
  double moe_router_topk_scaling_factor = 1.0;  // --moe-router-topk-scaling-factor (1: none)
  // Megatron-Core's DeepSeek-V3 style routing (MoeGate::megatron): --moe-router-score-function
  // (softmax, sigmoid or sqrtsoftplus), group-limited top-k (--moe-router-num-groups,
  // --moe-router-group-topk; group_topk 0: no groups) and the aux-loss-free expert bias
  // (--moe-router-enable-expert-bias, moved by --moe-router-bias-update-rate after every step).
  std::string moe_router_score_function = "softmax";
  int moe_router_num_groups = 0;
  int moe_router_group_topk = 0;
  bool moe_router_enable_expert_bias = false;
  double moe_router_bias_update_rate = 1e-3;
  // --moe-router-dtype: Megatron-Core's precision of the routing; weave routes in fp32 (MoE layers
  // train in fp32), so fp32 only.
  std::string moe_router_dtype = "fp32";
  // --moe-model-type deepspeed_moe on the command line routes by MindSpeed's gate; the embedding
  // API chooses the gate here and the experts' layout in ParallelPlan::moe_model_type.
  MoeGate moe_gate = MoeGate::megatron;
  double moe_train_capacity_factor = 1.0;  // --moe-train-capacity-factor (MoeGate::deepspeed)
  bool moe_no_drop = false;                // --moe-no-drop (MoeGate::deepspeed): capacity unbounded
  // --moe-use-sinkhorn (MoeGate::deepspeed): the gate routes on Sinkhorn-balanced logits.
  bool moe_use_sinkhorn = false;
  // --enable-token-rearrange-opt (MoeGate::deepspeed): MindSpeed dispatches and combines by
  // index_select; without it by dense einsums over the gate's one-hot [tokens, experts,
  // capacity] tensors. The same rows and weights either way: only the time differs.
  bool moe_token_rearrange = false;
  // --moe-token-drop-policy probs (MoeGate::megatron): an expert over capacity keeps its picks of
  // the largest weight; false (position): its earliest tokens'.
  bool moe_token_drop_by_probability = false;
  MoeLoadBalancing moe_load_balancing = MoeLoadBalancing::aux_loss;

  std::uint64_t seed = 1234;  // --seed

  // The tokenizer the data was made with (--tokenizer-type, --vocab-file, --merge-file): what
  // the vocabulary's ids mean. Checkpoints record it, so weave generate encodes and decodes with
  // it. Text files are bytes, as ByteTokenizer's first 256 ids.
  std::string tokenizer_type = "ByteTokenizer";
  std::string vocab_file, merge_file;

  Precision precision = Precision::fp32;  // --bf16, --fp16 (predicted only: see Precision)
  // --fp32-residual-connection: a 16-bit run's residual stream (and its gradient) in fp32, as
  // Megatron-LM's fp32_residual_connection keeps it; without it the stream is a 16-bit tensor,
  // as Megatron-LM's is under --bf16 and --fp16. Refused in an fp32 run, as Megatron-LM does.
  bool fp32_residual_connection = false;
  Recompute recompute;  // --recompute-granularity and the flags it takes

  // Bytes of one activation, communicated value or element-wise operand in this precision.
  int activation_bytes() const { return precision == Precision::fp32 ? 4 : 2; }
  // Bytes of one value of the residual stream, its gradient and what the pipeline's stages send
  // each other (Megatron-LM's pipeline_dtype): a 16-bit run's are 16-bit values but with
  // --fp32-residual-connection.
  int residual_stream_bytes() const { return fp32_residual_connection ? 4 : activation_bytes(); }

  int positions() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  // Each attention head's width: --kv-channels, or hidden / heads without it.
  int head_dim() const { return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads; }
  // The core attention holds its s x s scores (AttentionBackend unfused or local).
  bool materialised_scores() const {
    return attention_backend == AttentionBackend::unfused ||
           attention_backend == AttentionBackend::local;
  }
  int query_groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  // The dimensions of each head that RoPE rotates: an even count.
  int rotary_dims() const { return static_cast<int>(head_dim() * rotary_percent) / 2 * 2; }
  bool learned_positions() const {
    return position_embedding == PositionEmbedding::learned_absolute;
  }
  // The vocabulary padded to a multiple of make_vocab_size_divisible_by x tp, as Megatron does.
  int padded_vocab_size(int tensor_parallel) const;
  // The routed experts' hidden size (moe_ffn_hidden_size, or ffn_hidden_size when unset).
  int expert_ffn_hidden_size() const {
    return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn_hidden_size;
  }
  bool has_shared_experts() const {
    return num_experts > 0 && moe_shared_expert_intermediate_size > 0;
  }
  bool is_moe_layer(int layer) const {
    if (num_experts <= 0) return false;
    if (!moe_layer_pattern.empty())
      return layer >= 0 && layer < static_cast<int>(moe_layer_pattern.size()) &&
             moe_layer_pattern[static_cast<std::size_t>(layer)] == 1;
    return layer % moe_layer_freq == 0;
  }
};

}  // namespace weave::graphs
