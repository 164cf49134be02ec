// The model's flags: the decoder's shape, its positions and norms, and its Mixture of Experts.
#include <vector>

#include "config/config_flag_groups.hpp"
#include "weave/graphs/moe_layer_freq.hpp"

namespace weave::graphs::flag_groups {

namespace {

using enum DescribedSection;
using M = ModelConfig;

constexpr ConfigFlag kModel[] = {
    {.name = "--num-layers",
     .help = "Transformer layers",
     .field = model_field<&M::num_layers>(),
     .check = at_least(1),
     .description = described(model, "num_layers", true),
     .properties = kShowsDefault},
    {.name = "--hidden-size",
     .help = "Width of the hidden states",
     .field = model_field<&M::hidden_size>(),
     .check = at_least(1),
     .description = described(model, "hidden_size", true),
     .properties = kShowsDefault},
    {.name = "--num-attention-heads",
     .help = "Attention heads, each --hidden-size / heads wide (or --kv-channels)",
     .field = model_field<&M::num_attention_heads>(),
     .check = at_least(1),
     .description = described(model, "num_attention_heads", true),
     .properties = kShowsDefault},
    {.name = "--ffn-hidden-size",
     .help = "Width of the MLPs' (and experts') hidden layer; default as Megatron-LM's: 4 x "
             "--hidden-size, with --swiglu 2/3 of that rounded down to a multiple of 64",
     .field = model_field<&M::ffn_hidden_size>(),
     .check = at_least(1),
     .description = described(model, "ffn_hidden_size", true)},
    {.name = "--seq-length",
     .help = "Tokens per sample",
     .field = model_field<&M::seq_length>(),
     .check = at_least(1),
     .description = described(model, "seq_length", true),
     .properties = kShowsDefault},
    {.name = "--max-position-embeddings",
     .help = "Positions the position table holds (0: --seq-length)",
     .field = model_field<&M::max_position_embeddings>(),
     .description = {.section = model,
                     .key = "max_position_embeddings",
                     .checkpointed = true,
                     .value = [](const TrainerConfig& c) -> DescribedValue {
                       return std::int64_t{c.model.positions()};
                     }},
     .properties = kShowsDefault},
    {.name = "--make-vocab-size-divisible-by",
     .help = "Pad the tokenizer's vocabulary to a multiple of this x tp, as Megatron pads it",
     .field = model_field<&M::make_vocab_size_divisible_by>(),
     .check = at_least(1),
     .description = described(model, "make_vocab_size_divisible_by", true),
     .properties = kShowsDefault},
    {.name = "--swiglu",
     .values = 0,
     .help = "SwiGLU MLPs instead of GELU",
     .description = {.section = model,
                     .key = "swiglu",
                     .checkpointed = true,
                     .value = [](const TrainerConfig& c) -> DescribedValue {
                       return c.model.activation == Activation::swiglu;
                     }}},
    {.name = "--position-embedding-type",
     .help = "learned_absolute: a learned table added to the input; rope: rotary embeddings of "
             "queries and keys; none",
     .description = added_to_checkpoints({.section = model,
                                          .key = "position_embedding_type",
                                          .checkpointed = true,
                                          .value = [](const TrainerConfig& c) -> DescribedValue {
                                            return std::string(position_embedding_name(
                                                c.model.position_embedding));
                                          }}),
     .properties = kShowsDefault},
    {.name = "--attention-backend",
     .help = "The core attention's kernel, Megatron-Core's names: flash, fused or auto (a fused "
             "kernel that never holds the scores) or unfused or local (the s x s scores "
             "materialised: their products, softmax and dropout priced by their FLOPs and memory "
             "traffic, and held for the backward); weave's own kernel computes the same either "
             "way",
     .description = {.section = model,
                     .key = "attention_backend",
                     .value = [](const TrainerConfig& c) -> DescribedValue {
                       return std::string(attention_backend_name(c.model.attention_backend));
                     }},
     .properties = kShowsDefault,
     .type_name = "flash|fused|unfused|local|auto"},
    {.name = "--cross-entropy-loss-fusion",
     .values = 0,
     .help = "The loss over the vocabulary as Megatron-Core's fused cross-entropy "
             "(--cross-entropy-fusion-impl): fewer passes over the logits, priced by their memory "
             "traffic; weave computes the same loss either way",
     .description = {.section = model,
                     .key = "cross_entropy_fusion",
                     .value = [](const TrainerConfig& c) -> DescribedValue {
                       return std::string(cross_entropy_fusion_name(c.model.cross_entropy_fusion));
                     }}},
    {.name = "--cross-entropy-fusion-impl",
     .help = "With --cross-entropy-loss-fusion: native (Megatron-Core's jit-fused steps over fp32 "
             "logits) or te (Transformer Engine's online-softmax kernels over the logits in their "
             "own precision)",
     .properties = kShowsDefault,
     .type_name = "native|te"},
    {.name = "--use-rotary-position-embeddings",
     .values = 0,
     .help = "Megatron's older spelling of --position-embedding-type rope"},
    {.name = "--no-position-embedding",
     .values = 0,
     .help = "No learned position table (with neither rope: --position-embedding-type none)"},
    {.name = "--rotary-percent",
     .help = "Share of each head's dimensions RoPE rotates, in (0, 1]",
     .field = model_field<&M::rotary_percent>(),
     .description = added_to_checkpoints(described(model, "rotary_percent", true)),
     .properties = kShowsDefault},
    {.name = "--rotary-base",
     .help = "RoPE's base: angle base^(-2i / dims) x position",
     .field = model_field<&M::rotary_base>(),
     .description = added_to_checkpoints(described(model, "rotary_base", true)),
     .properties = kShowsDefault},
    {.name = "--normalization",
     .help = "LayerNorm or RMSNorm, for every norm",
     .description = added_to_checkpoints({.section = model,
                                          .key = "normalization",
                                          .checkpointed = true,
                                          .value = [](const TrainerConfig& c) -> DescribedValue {
                                            return std::string(c.model.normalization ==
                                                                       Normalization::rms_norm
                                                                   ? "RMSNorm"
                                                                   : "LayerNorm");
                                          }}),
     .properties = kShowsDefault},
    {.name = "--qk-layernorm",
     .values = 0,
     .help = "Norm (per --normalization) each head's queries and keys before attention",
     .field = model_field<&M::qk_layernorm>(),
     .description = added_to_checkpoints(described(model, "qk_layernorm", true))},
    {.name = "--bf16",
     .values = 0,
     .help = "bf16 mixed precision, as Megatron-LM trains it: bf16 products and saved "
             "activations, fp32 main parameters, gradients (reduced in fp32), norms, softmax and "
             "loss; the residual stream in bf16 (fp32 with --fp32-residual-connection). With "
             "tensor (+ sequence), data, pipeline, "
             "expert and context parallelism, Ampipe, the distributed optimizer, recomputation, "
             "dense and MoE layers (the router in fp32) and shared experts"},
    {.name = "--fp16",
     .values = 0,
     .help = "fp16 mixed precision, as Megatron-LM trains it: as --bf16 in IEEE half (fp16 "
             "products and saved activations, fp32 main parameters and gradients), with a loss "
             "scaler (--loss-scale, or dynamic from --initial-loss-scale) and steps whose "
             "gradients overflow skipped. With everything --bf16 trains with, ZeRO stages 2 and 3 "
             "included (each replica unscales and checks its gradient shard, the overflow flag "
             "agreed over every rank), MoE layers' aux losses scaled as the loss"},
    {.name = "--fp32-residual-connection",
     .values = 0,
     .help = "With --bf16 or --fp16: the residual stream and its gradient in fp32, as "
             "Megatron-LM's flag keeps them (the layers add the residual in fp32 and the pipeline "
             "sends fp32); without it they are 16-bit tensors, each residual end rounded once. "
             "Refused in fp32 runs, as Megatron-LM refuses it",
     .field = model_field<&M::fp32_residual_connection>()},
    {.name = "--norm-epsilon",
     .aliases = "--layernorm-epsilon",
     .help = "The norms' epsilon",
     .field = model_field<&M::layernorm_epsilon>(),
     .check = kPositive,
     .description = added_to_checkpoints(described(model, "norm_epsilon", true)),
     .properties = kShowsDefault},
    {.name = "--group-query-attention",
     .values = 0,
     .help = "Grouped-query attention with --num-query-groups key/value heads"},
    {.name = "--num-query-groups",
     .help = "Key/value heads with --group-query-attention, each shared by heads / groups query "
             "heads",
     .check = at_least(1),
     .description = added_to_checkpoints({.section = model,
                                          .key = "num_query_groups",
                                          .checkpointed = true,
                                          .value = [](const TrainerConfig& c) -> DescribedValue {
                                            return std::int64_t{c.model.query_groups()};
                                          }})},
    {.name = "--kv-channels",
     .help = "Each attention head's width, as Megatron-LM's: the QKV projection maps --hidden-size "
             "to heads x this queries and groups x this keys and values, the output projection "
             "heads x this back; default --hidden-size / --num-attention-heads, which need not "
             "divide when it is given",
     .field = model_field<&M::kv_channels>(),
     .check = at_least(1),
     .description = added_to_checkpoints({.section = model,
                                          .key = "kv_channels",
                                          .checkpointed = true,
                                          .value = [](const TrainerConfig& c) -> DescribedValue {
                                            return std::int64_t{c.model.head_dim()};
                                          }})},
    {.name = "--untie-embeddings-and-output-weights",
     .values = 0,
     .help = "An output layer of its own instead of the word embedding's transpose",
     .field = model_field<&M::untie_embeddings_and_output_weights>(),
     .description =
         added_to_checkpoints(described(model, "untie_embeddings_and_output_weights", true))},
    {.name = "--disable-bias-linear",
     .values = 0,
     .help = "No biases in the attention's and the MLPs' linear layers",
     .description = added_to_checkpoints({.section = model,
                                          .key = "add_bias_linear",
                                          .checkpointed = true,
                                          .value = [](const TrainerConfig& c) -> DescribedValue {
                                            return c.model.add_bias_linear;
                                          }})},
    {.name = "--attention-dropout",
     .help = "Dropout on the attention probabilities, in [0, 1)",
     .field = model_field<&M::attention_dropout>(),
     .description = described(model, "attention_dropout"),
     .properties = kShowsDefault},
    {.name = "--hidden-dropout",
     .help = "Dropout after the attention and the MLP, in [0, 1)",
     .field = model_field<&M::hidden_dropout>(),
     .description = described(model, "hidden_dropout"),
     .properties = kShowsDefault},
    {.name = "--init-method-std",
     .help = "Standard deviation of the initial weights",
     .field = model_field<&M::init_method_std>(),
     .check = kPositive,
     .description = described(model, "init_method_std"),
     .properties = kShowsDefault},
    {.name = "--seed",
     .help = "Seed of the initial weights, dropout and mock data",
     .field = model_field<&M::seed>(),
     .description = described(model, "seed"),
     .properties = kShowsDefault},
};

// --moe-layer-freq as a checkpoint records it: a pattern that every N-th layer also gives is
// described as N, so a run spelling it either way loads the other's checkpoint (and checkpoints
// saved before patterns existed, which hold N).
DescribedValue describe_moe_layer_freq(const TrainerConfig& c) {
  const ModelConfig& m = c.model;
  const std::vector<int>& pattern = m.moe_layer_pattern;
  if (pattern.empty()) return std::int64_t{m.moe_layer_freq};
  for (int every = 1; every <= static_cast<int>(pattern.size()); ++every) {
    bool same = true;
    for (std::size_t l = 0; l < pattern.size() && same; ++l)
      same = pattern[l] == (static_cast<int>(l) % every == 0 ? 1 : 0);
    if (same) return std::int64_t{every};
  }
  return moe_layer_freq_text(m);
}

constexpr ConfigFlag kMoe[] = {
    {.name = "--num-experts",
     .group = FlagGroup::moe,
     .help = "0: dense model",
     .field = model_field<&M::num_experts>(),
     .check = at_least(0),
     .description = described(model, "num_experts", true),
     .properties = kShowsDefault},
    {.name = "--moe-layer-freq",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's MoE layers: N, one every N layers from the first; or a pattern of "
             "one 0 (dense) or 1 (MoE) per layer, as a list \"[0,1,1,0]\" or a sum of lists "
             "times counts \"([0]*3+[1]*5)\" (other Python expressions are refused)",
     .description = {.section = model,
                     .key = "moe_layer_freq",
                     .checkpointed = true,
                     .value = describe_moe_layer_freq},
     .properties = kShowsDefault,
     .type_name = "N|PATTERN"},
    {.name = "--moe-ffn-hidden-size",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's hidden size of each routed expert's MLP, apart from the dense "
             "layers' --ffn-hidden-size; unset: --ffn-hidden-size",
     .field = model_field<&M::moe_ffn_hidden_size>(),
     .check = kPositive,
     .description = added_to_checkpoints({.section = model,
                                          .key = "moe_ffn_hidden_size",
                                          .checkpointed = true,
                                          .value = [](const TrainerConfig& c) -> DescribedValue {
                                            return std::int64_t{c.model.expert_ffn_hidden_size()};
                                          }})},
    {.name = "--moe-shared-expert-intermediate-size",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's shared experts: one MLP this wide (the shared experts' widths "
             "summed; SwiGLU with --swiglu, no biases: needs --disable-bias-linear) that every "
             "token of a MoE layer passes through, its output added to the routed experts'; "
             "tensor-parallel like a dense MLP, replicated over expert parallelism; not with "
             "Ampipe",
     .field = model_field<&M::moe_shared_expert_intermediate_size>(),
     .check = kPositive,
     .description =
         added_to_checkpoints(described(model, "moe_shared_expert_intermediate_size", true))},
    {.name = "--moe-shared-expert-gate",
     .group = FlagGroup::moe,
     .values = 0,
     .help = "Megatron-Core's shared-expert gate (SharedExpertMLP's gate, Qwen2-MoE's): the "
             "shared experts' output multiplied by each token's sigmoid(w . x), x the MoE "
             "layer's input and w a weight of h values replicated over tensor parallelism",
     .field = model_field<&M::moe_shared_expert_gate>(),
     .description = added_to_checkpoints(described(model, "moe_shared_expert_gate", true))},
    {.name = "--moe-shared-expert-overlap",
     .group = FlagGroup::moe,
     .values = 0,
     .help = "Megatron-Core's overlap of the shared experts with the token dispatcher's "
             "all-to-alls (alltoall dispatcher): instead of running before the router, their "
             "input's sp gather and fc1 run while the dispatch all-to-all is in flight, fc2 and "
             "its reduction while the combine's is (the backward mirrored: fc2's under the "
             "combine's gradient, fc1's under the dispatch's); the same numbers",
     .field = model_field<&M::moe_shared_expert_overlap>(),
     .description = described(model, "moe_shared_expert_overlap")},
    {.name = "--moe-router-topk",
     .group = FlagGroup::moe,
     .help = "Experts each token is routed to",
     .field = model_field<&M::moe_router_topk>(),
     .check = at_least(1),
     .description = added_to_checkpoints(described(model, "moe_router_topk", true)),
     .properties = kShowsDefault},
    {.name = "--moe-aux-loss-coeff",
     .group = FlagGroup::moe,
     .help = "Weight of the load-balancing loss, >= 0",
     .field = model_field<&M::moe_aux_loss_coeff>(),
     .description = described(model, "moe_aux_loss_coeff"),
     .properties = kShowsDefault},
    {.name = "--moe-z-loss-coeff",
     .group = FlagGroup::moe,
     .help = "Weight of the router's z-loss, >= 0",
     .field = model_field<&M::moe_z_loss_coeff>(),
     .description = described(model, "moe_z_loss_coeff"),
     .properties = kShowsDefault},
    {.name = "--moe-expert-capacity-factor",
     .group = FlagGroup::moe,
     .help = "0: dropless",
     .field = model_field<&M::moe_expert_capacity_factor>(),
     .description = described(model, "moe_expert_capacity_factor"),
     .properties = kShowsDefault},
    {.name = "--moe-router-load-balancing-type",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's load balancing: aux_loss (the loss of the micro-batch's tokens, "
             "weighted by --moe-aux-loss-coeff), seq_aux_loss (each sequence's loss over its own "
             "tokens, averaged over the micro-batch's sequences), sinkhorn (in training each "
             "token picks the top-k of its rank's Sinkhorn-balanced logits, weighed by the "
             "softmax scores, top-1 by the sigmoid, unrenormalised; no balancing loss: needs "
             "--moe-aux-loss-coeff 0, no capacity factor, no Ampipe) or none (no balancing loss, "
             "the coefficient ignored). MindSpeed's deepspeed_moe gate never reads it, and "
             "weave's ignores it too",
     .check = one_of("aux_loss,seq_aux_loss,sinkhorn,none"),
     // Saved as the router routes (none: aux_loss), since a sinkhorn router weighs its picks
     // otherwise when decoding.
     .description = added_to_checkpoints({.section = model,
                                          .key = "moe_router_load_balancing_type",
                                          .checkpointed = true,
                                          .value = [](const TrainerConfig& c) -> DescribedValue {
                                            switch (c.model.moe_load_balancing) {
                                              case MoeLoadBalancing::seq_aux_loss:
                                                return std::string("seq_aux_loss");
                                              case MoeLoadBalancing::sinkhorn:
                                                return std::string("sinkhorn");
                                              case MoeLoadBalancing::aux_loss:
                                                break;
                                            }
                                            return std::string("aux_loss");
                                          }}),
     .properties = kShowsDefault},
    {.name = "--moe-router-topk-scaling-factor",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's factor on the top-k weights (after renormalisation), as "
             "DeepSeek-V3's routed scaling factor; 1: none. MindSpeed's deepspeed_moe gate "
             "ignores it, as weave's does",
     .field = model_field<&M::moe_router_topk_scaling_factor>(),
     .description = described(model, "moe_router_topk_scaling_factor"),
     .properties = kShowsDefault},
    {.name = "--moe-router-score-function",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's router scores: softmax over the experts, or each expert's own "
             "score, sigmoid (DeepSeek-V3's) or sqrtsoftplus (sqrt(softplus(logit))), divided by "
             "the picks' sum when top-k > 1 (--moe-router-pre-softmax then has no effect), and by "
             "the sum over every expert for the load-balancing loss. MindSpeed's deepspeed_moe "
             "gate takes softmax only",
     .field = model_field<&M::moe_router_score_function>(),
     .check = one_of("softmax,sigmoid,sqrtsoftplus"),
     .description = added_to_checkpoints(described(model, "moe_router_score_function", true)),
     .properties = kShowsDefault},
    {.name = "--moe-router-num-groups",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's group-limited routing: the experts in this many equal groups of "
             "consecutive experts (e.g. the expert-parallel size: device-limited routing); no "
             "effect without --moe-router-group-topk, as in Megatron-Core",
     .field = model_field<&M::moe_router_num_groups>(),
     .check = at_least(0),
     .description = added_to_checkpoints(described(model, "moe_router_num_groups", true))},
    {.name = "--moe-router-group-topk",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's group-limited routing: each token picks its experts from this many "
             "groups, those whose top (top-k / group-topk) routing scores sum highest",
     .field = model_field<&M::moe_router_group_topk>(),
     .check = at_least(0),
     .description = added_to_checkpoints(described(model, "moe_router_group_topk", true))},
    {.name = "--moe-router-enable-expert-bias",
     .group = FlagGroup::moe,
     .values = 0,
     .help = "Megatron-Core's aux-loss-free load balancing (sigmoid or sqrtsoftplus scores): a "
             "per-expert bias added to the scores to choose the experts, not to weigh them, moved "
             "after every step by --moe-router-bias-update-rate towards the mean load of the "
             "step's tokens over every replica; saved in checkpoints",
     .field = model_field<&M::moe_router_enable_expert_bias>(),
     .description = added_to_checkpoints(described(model, "moe_router_enable_expert_bias", true))},
    {.name = "--moe-router-bias-update-rate",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's step of the expert bias: each step it grows by this for the "
             "experts that took fewer picks than the mean and shrinks by it for those that took "
             "more",
     .field = model_field<&M::moe_router_bias_update_rate>(),
     .description = described(model, "moe_router_bias_update_rate"),
     .properties = kShowsDefault},
    {.name = "--moe-router-dtype",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's precision of the router's scores and of the weighted sum of the "
             "experts' outputs: weave computes both in fp32, so fp32 (fp64 is refused)",
     .field = model_field<&M::moe_router_dtype>(),
     .check = one_of("fp32,fp64"),
     .properties = kShowsDefault},
    {.name = "--moe-router-pre-softmax",
     .group = FlagGroup::moe,
     .values = 0,
     .help = "Megatron-Core's pre-softmax routing: the top-k weights are the softmax over all "
             "experts, not renormalised over the k picks. MindSpeed's deepspeed_moe gate "
             "ignores it, as weave's does"},
    {.name = "--moe-token-drop-policy",
     .group = FlagGroup::moe,
     .help = "Megatron-Core's choice of the picks an expert over --moe-expert-capacity-"
             "factor's capacity keeps: probs (Megatron-Core's default: those of the largest "
             "weight) or position (the earliest tokens'). MindSpeed's deepspeed_moe gate "
             "ignores it, as weave's does",
     .check = one_of("probs,position"),
     .properties = kShowsDefault},
    {.name = "--moe-train-capacity-factor",
     .group = FlagGroup::moe,
     .help = "With --moe-model-type deepspeed_moe (MindSpeed's gate): each expert takes at most "
             "ceil(tokens / experts x top-k x factor) picks of each gate call, at least 4",
     .field = model_field<&M::moe_train_capacity_factor>(),
     .description = described(model, "moe_train_capacity_factor"),
     .properties = kShowsDefault},
    {.name = "--moe-no-drop",
     .group = FlagGroup::moe,
     .values = 0,
     .help = "With --moe-model-type deepspeed_moe (MindSpeed's gate): no capacity, no pick dropped",
     .field = model_field<&M::moe_no_drop>(),
     .description = described(model, "moe_no_drop")},
    {.name = "--moe-use-sinkhorn",
     .group = FlagGroup::moe,
     .values = 0,
     .help = "With --moe-model-type deepspeed_moe (MindSpeed's gate): each gate call's logits "
             "Sinkhorn-balanced over its tokens and experts before the softmax, and the gradient "
             "taken back through every round",
     .field = model_field<&M::moe_use_sinkhorn>(),
     .description = described(model, "moe_use_sinkhorn")},
    {.name = "--enable-token-rearrange-opt",
     .group = FlagGroup::moe,
     .values = 0,
     .help = "With --moe-model-type deepspeed_moe (MindSpeed's gate): dispatch and combine by "
             "index_select, each picked row copied, instead of MindSpeed's default dense einsums "
             "over the one-hot [tokens, experts, capacity] tensors (products the virtual clock "
             "prices); the same rows and weights. Megatron-Core's router takes no such einsums: "
             "no effect there",
     .field = model_field<&M::moe_token_rearrange>(),
     .description = described(model, "moe_token_rearrange")},
};

}  // namespace

std::span<const ConfigFlag> model_flags() {
  return kModel;
}

std::span<const ConfigFlag> moe_flags() {
  return kMoe;
}

}  // namespace weave::graphs::flag_groups
