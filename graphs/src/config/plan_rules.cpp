#include "config/plan_rules.hpp"

#include <fmt/format.h>

#include <cmath>
#include <utility>

#include "config/layer_spec.hpp"
#include "config/plan_derivation.hpp"
#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/pipeline_layout.hpp"

namespace weave::graphs {

namespace {

template <typename... Args>
[[noreturn]] void refuse(fmt::format_string<Args...> format, Args&&... args) {
  throw ConfigError(fmt::format(format, std::forward<Args>(args)...));
}

void require_positive(const char* flag, long long value) {
  if (value < 1) refuse("{} must be >= 1, got {}", flag, value);
}

// Every size the other rules divide by or multiply.
void check_sizes_are_positive(const ModelConfig& m, const ParallelPlan& p) {
  require_positive("--num-layers", m.num_layers);
  require_positive("--hidden-size", m.hidden_size);
  require_positive("--num-attention-heads", m.num_attention_heads);
  require_positive("--ffn-hidden-size", m.ffn_hidden_size);
  require_positive("--seq-length", m.seq_length);
  require_positive("--tensor-model-parallel-size", p.tensor_parallel);
  require_positive("--context-parallel-size", p.context_parallel);
  require_positive("--expert-model-parallel-size", p.expert_parallel);
  require_positive("--pipeline-model-parallel-size", p.pipeline_parallel);
  require_positive("the data-parallel size", p.data_parallel);
  require_positive("--micro-batch-size", p.micro_batch_size);
  require_positive("--global-batch-size", p.global_batch_size);
  require_positive("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by);
  if (m.kv_channels < 0)
    refuse("--kv-channels must be >= 1 (or unset: --hidden-size / --num-attention-heads), got {}",
           m.kv_channels);
}

// The device count and the padded vocabulary stay small enough to multiply in an int.
void check_sizes_fit(const ModelConfig& m, const ParallelPlan& p) {
  // One factor at a time, in 64 bits: the running product stays below kMaxDevices before each
  // multiplication, so it cannot overflow.
  long long devices = 1;
  for (const int size :
       {p.tensor_parallel, p.context_parallel, p.data_parallel, p.pipeline_parallel}) {
    devices *= size;
    if (devices > kMaxDevices)
      refuse(
          "tensor x context x data x pipeline parallel ({} x {} x {} x {}) exceeds {} devices, "
          "more than weave lays out: lower the parallel sizes or --devices",
          p.tensor_parallel, p.context_parallel, p.data_parallel, p.pipeline_parallel, kMaxDevices);
  }
  if (1LL * m.make_vocab_size_divisible_by * p.tensor_parallel > (1 << 30) ||
      m.vocab_size > (1 << 30))
    refuse(
        "the vocabulary ({} tokens, padded to a multiple of --make-vocab-size-divisible-by {} x "
        "--tensor-model-parallel-size {}) must stay below 2^30 rows",
        m.vocab_size, m.make_vocab_size_divisible_by, p.tensor_parallel);
}

// Tensor parallelism splits heads and the MLP's first linear.
void check_tensor_parallel(const ModelConfig& m, const ParallelPlan& p) {
  const int tp = p.tensor_parallel;
  // Megatron-LM asks for the division only when it derives the heads' width from it.
  if (m.kv_channels == 0 && m.hidden_size % m.num_attention_heads != 0)
    refuse(
        "--hidden-size ({}) must be divisible by --num-attention-heads ({}): without "
        "--kv-channels every head has hidden / heads dimensions. Give --kv-channels (each "
        "head's width) or choose sizes that divide",
        m.hidden_size, m.num_attention_heads);
  if (m.num_attention_heads % tp != 0)
    refuse(
        "--num-attention-heads ({}) must be divisible by --tensor-model-parallel-size ({}): "
        "each tensor-parallel rank holds whole heads",
        m.num_attention_heads, tp);
  if (m.ffn_hidden_size % tp != 0)
    refuse(
        "--ffn-hidden-size ({}) must be divisible by --tensor-model-parallel-size ({}): the "
        "MLP's first linear is split by columns",
        m.ffn_hidden_size, tp);
}

void check_position_embeddings(const ModelConfig& m) {
  if (m.positions() < m.seq_length)
    refuse("--max-position-embeddings ({}) must be >= --seq-length ({})", m.positions(),
           m.seq_length);
}

void check_sequence_parallel(const ModelConfig& m, const ParallelPlan& p) {
  if (p.sequence_parallel && m.seq_length % p.tensor_parallel != 0)
    refuse(
        "--seq-length ({}) must be divisible by --tensor-model-parallel-size ({}) under "
        "--sequence-parallel: each rank holds seq/tp positions",
        m.seq_length, p.tensor_parallel);
}

void check_context_parallel(const ModelConfig& m, const ParallelPlan& p) {
  const int cp = p.context_parallel, sp = p.sequence_parallel ? p.tensor_parallel : 1;
  if (cp > 1 && m.seq_length % (2 * cp * sp) != 0)
    refuse(
        "--seq-length ({}) must be divisible by 2 x --context-parallel-size{} ({}): the "
        "sequence is cut into 2 x cp load-balanced chunks{}",
        m.seq_length, sp > 1 ? " x --tensor-model-parallel-size" : "", 2 * cp * sp,
        sp > 1 ? ", each split again over the sequence-parallel ranks" : "");
}

// The experts, their routing, and expert parallelism only with experts.
void check_moe_model(const ModelConfig& m, const ParallelPlan& p) {
  if (m.num_experts < 0) refuse("--num-experts must be >= 0, got {}", m.num_experts);
  if (m.moe_ffn_hidden_size < 0)
    refuse("--moe-ffn-hidden-size must be >= 1, got {}", m.moe_ffn_hidden_size);
  if (m.num_experts == 0) {
    if (p.expert_parallel > 1)
      refuse("--expert-model-parallel-size ({}) needs --num-experts > 0", p.expert_parallel);
    // An expert width without experts: Megatron-Core's TransformerConfig refuses it (or, when
    // --moe-layer-freq leaves dense layers, ignores it with a warning); weave refuses it.
    if (m.moe_ffn_hidden_size > 0)
      refuse(
          "--moe-ffn-hidden-size ({}) sets the routed experts' width and the model has none: set "
          "--num-experts or drop it",
          m.moe_ffn_hidden_size);
    return;
  }
  if (p.expert_tensor_parallel > 1 && p.expert_tensor_parallel == p.tensor_parallel &&
      m.expert_ffn_hidden_size() % p.expert_tensor_parallel != 0)
    refuse(
        "the experts' hidden size (--moe-ffn-hidden-size, else --ffn-hidden-size: {}) must be "
        "divisible by --expert-tensor-parallel-size ({}): each expert's first linear is split "
        "by columns",
        m.expert_ffn_hidden_size(), p.expert_tensor_parallel);
  if (m.moe_layer_pattern.empty()) require_positive("--moe-layer-freq", m.moe_layer_freq);
  // Megatron-Core's rule (gpt_layer_specs): the pattern names every layer.
  if (!m.moe_layer_pattern.empty() &&
      m.moe_layer_pattern.size() != static_cast<std::size_t>(m.num_layers))
    refuse(
        "--moe-layer-freq's pattern has {} entries and --num-layers is {}: give one entry per "
        "layer (1: MoE, 0: dense)",
        m.moe_layer_pattern.size(), m.num_layers);
  for (const int moe : m.moe_layer_pattern)
    if (moe != 0 && moe != 1)
      refuse("--moe-layer-freq's pattern holds {}: its entries are 1 (MoE) or 0 (dense)", moe);
  if (m.moe_router_topk < 1 || m.moe_router_topk > m.num_experts)
    refuse("--moe-router-topk ({}) must be between 1 and --num-experts ({})", m.moe_router_topk,
           m.num_experts);
  if (m.num_experts % p.expert_parallel != 0)
    refuse(
        "--num-experts ({}) must be divisible by --expert-model-parallel-size ({}): each "
        "expert-parallel rank holds the same number of experts",
        m.num_experts, p.expert_parallel);
  if (!(m.moe_router_topk_scaling_factor > 0) || !std::isfinite(m.moe_router_topk_scaling_factor))
    refuse("--moe-router-topk-scaling-factor must be a finite number > 0, got {}",
           m.moe_router_topk_scaling_factor);
  if (m.moe_expert_capacity_factor < 0)
    refuse("--moe-expert-capacity-factor must be >= 0 (0: dropless), got {}",
           m.moe_expert_capacity_factor);
}

// Megatron-Core's shared experts (SharedExpertMLP) and its rules (TransformerConfig's checks and
// the module's bias assertion), plus the places weave does not run them.
void check_shared_experts(const ModelConfig& m, const ParallelPlan& p) {
  const int width = m.moe_shared_expert_intermediate_size;
  if (width < 0)
    refuse(
        "--moe-shared-expert-intermediate-size must be >= 1 (the shared experts' widths "
        "summed), got {}",
        width);
  if (width == 0) {
    if (m.moe_shared_expert_overlap)
      refuse(
          "--moe-shared-expert-overlap overlaps the shared experts and the model has none: set "
          "--moe-shared-expert-intermediate-size or drop it");
    if (m.moe_shared_expert_gate)
      refuse(
          "--moe-shared-expert-gate gates the shared experts and the model has none: set "
          "--moe-shared-expert-intermediate-size or drop it");
    return;
  }
  if (m.num_experts == 0)
    refuse(
        "--moe-shared-expert-intermediate-size ({}) adds shared experts to the MoE layers and the "
        "model has none: set --num-experts or drop it",
        width);
  if (m.add_bias_linear)
    refuse(
        "--moe-shared-expert-intermediate-size ({}): the shared experts have no biases "
        "(Megatron-Core's rule): add --disable-bias-linear",
        width);
  if (width % p.tensor_parallel != 0)
    refuse(
        "--moe-shared-expert-intermediate-size ({}) must be divisible by "
        "--tensor-model-parallel-size ({}): the shared experts' first linear is split by columns",
        width, p.tensor_parallel);
  if (p.ampipe_degree > 1)
    refuse(
        "--moe-shared-expert-intermediate-size with --ampipe-degree {}: MindSpeed's Ampipe MoE "
        "layer has no shared experts: drop one of them",
        p.ampipe_degree);
  if (p.pipe_experts)
    refuse(
        "--moe-shared-expert-intermediate-size with --use-pipe-experts: MindSpeed's pipe-experts "
        "MoE layer has no shared experts: drop one of them");
  if (m.moe_gate != MoeGate::megatron)
    refuse(
        "--moe-shared-expert-intermediate-size with --moe-model-type deepspeed_moe: MindSpeed's "
        "DeepSpeed-style MoE layer has no shared experts: drop one of them");
}

// Megatron-Core's sigmoid and sqrtsoftplus scores, group-limited routing and expert bias: its
// rules (TransformerConfig's checks), plus those its top-k calls would fail on.
void check_router_routing(const ModelConfig& m) {
  const std::string& score = m.moe_router_score_function;
  const bool per_expert = score == "sigmoid" || score == "sqrtsoftplus";
  if (!per_expert && score != "softmax")
    refuse("--moe-router-score-function must be softmax, sigmoid or sqrtsoftplus, got '{}'", score);
  if (m.moe_router_enable_expert_bias && !per_expert)
    refuse(
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or "
        "sqrtsoftplus (Megatron-Core's rule), got {}: add one of them or drop the bias",
        score);
  if (!(m.moe_router_bias_update_rate >= 0) || !std::isfinite(m.moe_router_bias_update_rate))
    refuse("--moe-router-bias-update-rate must be a finite number >= 0, got {}",
           m.moe_router_bias_update_rate);
  if (m.moe_router_num_groups < 0 || m.moe_router_group_topk < 0)
    refuse("--moe-router-num-groups ({}) and --moe-router-group-topk ({}) must be >= 0",
           m.moe_router_num_groups, m.moe_router_group_topk);
  if (m.moe_router_group_topk == 0) return;
  const int groups = m.moe_router_num_groups;
  if (groups == 0)
    refuse(
        "--moe-router-group-topk ({}) needs --moe-router-num-groups (Megatron-Core's rule): give "
        "the number of expert groups, e.g. the expert-parallel size",
        m.moe_router_group_topk);
  if (m.num_experts % groups != 0)
    refuse(
        "--num-experts ({}) must be divisible by --moe-router-num-groups ({}) (Megatron-Core's "
        "rule): choose a number of groups that divides the experts",
        m.num_experts, groups);
  if (m.moe_router_group_topk > groups)
    refuse(
        "--moe-router-group-topk ({}) must be at most --moe-router-num-groups ({}) "
        "(Megatron-Core's rule)",
        m.moe_router_group_topk, groups);
  if (m.moe_router_group_topk > m.moe_router_topk)
    refuse(
        "--moe-router-group-topk ({}) must be at most --moe-router-topk ({}): each chosen group is "
        "scored by its top (topk / group-topk) experts, none when group-topk exceeds topk",
        m.moe_router_group_topk, m.moe_router_topk);
  if (m.moe_router_topk > m.moe_router_group_topk * (m.num_experts / groups))
    refuse(
        "--moe-router-topk ({}) needs at least that many experts in the {} chosen groups of {} "
        "experts: raise --moe-router-group-topk or lower --moe-router-topk",
        m.moe_router_topk, m.moe_router_group_topk, m.num_experts / groups);
}

// --moe-router-load-balancing-type seq_aux_loss and sinkhorn: Megatron-Core's router's, with its
// rules (TopKRouter's assert, TransformerConfig's capacity check) and what its sinkhorn routing
// never reads refused rather than ignored.
void check_load_balancing(const ModelConfig& m, const ParallelPlan& p) {
  if (m.num_experts == 0 || m.moe_load_balancing == MoeLoadBalancing::aux_loss) return;
  const char* type =
      m.moe_load_balancing == MoeLoadBalancing::sinkhorn ? "sinkhorn" : "seq_aux_loss";
  if (m.moe_gate != MoeGate::megatron)
    refuse(
        "ModelConfig::moe_load_balancing {} is Megatron-Core's router's; MindSpeed's "
        "deepspeed_moe gate balances by its own loss (or --moe-use-sinkhorn): leave aux_loss or "
        "use MoeGate::megatron",
        type);
  if (m.moe_load_balancing != MoeLoadBalancing::sinkhorn) return;
  if (m.moe_aux_loss_coeff != 0)
    refuse(
        "--moe-router-load-balancing-type sinkhorn takes no load-balancing loss (Megatron-Core "
        "asserts it), got --moe-aux-loss-coeff {}: give 0",
        m.moe_aux_loss_coeff);
  if (m.moe_expert_capacity_factor != 0)
    refuse(
        "--moe-expert-capacity-factor ({}) works with the aux_loss, seq_aux_loss or none load "
        "balancing only (Megatron-Core's rule), not sinkhorn: drop one of them",
        m.moe_expert_capacity_factor);
  if (m.moe_router_score_function != "softmax" || m.moe_router_group_topk != 0 ||
      m.moe_router_enable_expert_bias || m.moe_router_topk_scaling_factor != 1 ||
      !m.moe_router_renormalize)
    refuse(
        "--moe-router-load-balancing-type sinkhorn picks by the balanced logits and weighs by the "
        "softmax (top-1: the sigmoid) alone; Megatron-Core's sinkhorn routing would ignore "
        "--moe-router-score-function {}, --moe-router-group-topk, --moe-router-enable-expert-"
        "bias, --moe-router-topk-scaling-factor and --moe-router-pre-softmax: drop them",
        m.moe_router_score_function);
  if (p.ampipe_degree > 1)
    refuse(
        "--moe-router-load-balancing-type sinkhorn balances each rank's tokens of a micro-batch "
        "at once (Megatron-Core's router), and --ampipe-degree {} routes them by chunk: drop one "
        "of them (MindSpeed's Ampipe routes by its deepspeed_moe gate, --moe-use-sinkhorn)",
        p.ampipe_degree);
}

// The DeepSpeed-style gate's settings (MindSpeed's deepspeed_moe), and Megatron's router's.
void check_moe_gate(const ModelConfig& m, const ParallelPlan& p) {
  if (m.num_experts == 0) return;
  if (m.moe_router_dtype != "fp32")
    refuse(
        "--moe-router-dtype {}: weave's router computes its scores and weighs the experts' outputs "
        "in fp32 only: give fp32 or drop the flag",
        m.moe_router_dtype);
  if (m.moe_gate == MoeGate::deepspeed &&
      (m.moe_router_score_function != "softmax" || m.moe_router_group_topk != 0 ||
       m.moe_router_enable_expert_bias))
    refuse(
        "--moe-router-score-function {}, --moe-router-group-topk and "
        "--moe-router-enable-expert-bias are Megatron-Core's router's; MindSpeed's deepspeed_moe "
        "gate takes softmax top-k only: drop them or use --moe-model-type megatron",
        m.moe_router_score_function);
  if (m.moe_gate != MoeGate::deepspeed) {
    check_router_routing(m);
    if (m.moe_no_drop || m.moe_train_capacity_factor != 1.0 || m.moe_use_sinkhorn)
      refuse(
          "--moe-no-drop, --moe-use-sinkhorn and --moe-train-capacity-factor ({}) set MindSpeed's "
          "deepspeed_moe gate: add --moe-model-type deepspeed_moe, or give Megatron's "
          "--moe-expert-capacity-factor",
          m.moe_train_capacity_factor);
    return;
  }
  if (m.moe_router_topk != 1 && m.moe_router_topk != 2)
    refuse(
        "--moe-model-type deepspeed_moe routes top-1 or top-2 (MindSpeed's gate), got "
        "--moe-router-topk {}",
        m.moe_router_topk);
  if (!(m.moe_train_capacity_factor > 0) || !std::isfinite(m.moe_train_capacity_factor))
    refuse("--moe-train-capacity-factor must be > 0 (MindSpeed's rule), got {}",
           m.moe_train_capacity_factor);
  if (m.moe_expert_capacity_factor != 0)
    refuse(
        "--moe-expert-capacity-factor ({}) is Megatron's; MindSpeed's deepspeed_moe gate takes "
        "its capacity from --moe-train-capacity-factor: give that instead",
        m.moe_expert_capacity_factor);
  if (m.moe_z_loss_coeff != 0)
    refuse(
        "--moe-z-loss-coeff ({}) has no effect in MindSpeed's deepspeed_moe layer, which builds "
        "its gate without it: drop it, or use --moe-model-type megatron",
        m.moe_z_loss_coeff);
  if (m.moe_no_drop && p.pipeline_parallel > 1)
    refuse(
        "--moe-no-drop is not compatible with pipeline parallelism (MindSpeed's rule): drop "
        "it, or set --pipeline-model-parallel-size 1");
  // Without SP MindSpeed's gate routes the same tokens on every tp rank, its experts split over
  // them: whole experts would run them tp times, their gradients counted tp times.
  if (p.tensor_parallel > 1 && !p.sequence_parallel && !plan_splits_experts(p))
    refuse(
        "MindSpeed's deepspeed_moe gate with --tensor-model-parallel-size {} and no "
        "--sequence-parallel routes the same tokens on every tensor-parallel rank and splits "
        "every expert over them: set --moe-model-type deepspeed_moe (or "
        "--expert-tensor-parallel-size {})",
        p.tensor_parallel, p.tensor_parallel);
}

// --moe-model-type as given: deepspeed_moe splits the experts, so a different split contradicts
// it.
void check_moe_model_type(const ParallelPlan& given) {
  if (given.moe_model_type == "deepspeed_moe") {
    if (given.expert_tensor_parallel != 1 && given.expert_tensor_parallel != given.tensor_parallel)
      refuse(
          "--moe-model-type deepspeed_moe splits every expert over the tensor-parallel group: "
          "--expert-tensor-parallel-size ({}) must be --tensor-model-parallel-size ({}) or unset",
          given.expert_tensor_parallel, given.tensor_parallel);
  } else if (!given.moe_model_type.empty() && given.moe_model_type != "megatron_moe" &&
             given.moe_model_type != "megatron") {
    refuse(
        "--moe-model-type must be megatron or deepspeed_moe (or megatron_moe, MindSpeed's name "
        "for megatron), got '{}'",
        given.moe_model_type);
  }
}

// Experts are whole or split over the whole tensor-parallel group, and only experts split.
void check_expert_tensor_parallel(const ModelConfig& m, const ParallelPlan& p) {
  require_positive("--expert-tensor-parallel-size", p.expert_tensor_parallel);
  if (p.expert_tensor_parallel != 1 && p.expert_tensor_parallel != p.tensor_parallel)
    refuse(
        "--expert-tensor-parallel-size ({}) must be 1 (every expert whole on one rank) or "
        "--tensor-model-parallel-size ({}) (every expert split over the tensor-parallel group)",
        p.expert_tensor_parallel, p.tensor_parallel);
  if (p.expert_tensor_parallel > 1 && m.num_experts == 0)
    refuse("--expert-tensor-parallel-size ({}) splits experts: set --num-experts",
           p.expert_tensor_parallel);
}

// Expert-parallel groups are carved out of the ranks that hold the same expert shard.
void check_expert_parallel_groups(const ParallelPlan& p) {
  const int tp = p.tensor_parallel, cp = p.context_parallel, dp = p.data_parallel;
  if (p.expert_tensor_parallel > 1) {
    if ((cp * dp) % p.expert_parallel != 0)
      refuse(
          "--expert-model-parallel-size ({}) must divide context x data parallel ({} x {} = {}) "
          "when experts are split over the tensor-parallel group: an expert-parallel group is "
          "made of ranks with the same tensor-parallel rank",
          p.expert_parallel, cp, dp, cp * dp);
  } else if ((tp * cp * dp) % p.expert_parallel != 0) {
    refuse(
        "--expert-model-parallel-size ({}) must divide tensor x context x data parallel "
        "({} x {} x {} = {}): expert-parallel groups are carved out of those ranks",
        p.expert_parallel, tp, cp, dp, tp * cp * dp);
  }
}

void check_global_batch(const ParallelPlan& p) {
  const long long per_step = 1LL * p.micro_batch_size * p.data_parallel;
  if (p.global_batch_size % per_step != 0)
    refuse(
        "--global-batch-size ({}) must be divisible by --micro-batch-size x data-parallel size "
        "({} x {} = {})",
        p.global_batch_size, p.micro_batch_size, p.data_parallel, per_step);
}

// The virtual-stage flags as given: a count, or layers per chunk that divide each rank's layers
// into that count.
void check_virtual_stages(const ModelConfig& m, const ParallelPlan& given) {
  require_positive("--virtual-pipeline-model-parallel-size", given.virtual_pipeline);
  const int layers_per_chunk = given.layers_per_virtual_stage, pp = given.pipeline_parallel;
  if (layers_per_chunk < 0)
    refuse("--num-layers-per-virtual-pipeline-stage must be >= 1, got {}", layers_per_chunk);
  if (layers_per_chunk == 0) return;
  const int per_rank = m.num_layers / pp;
  if (m.num_layers % pp != 0 || per_rank % layers_per_chunk != 0)
    refuse(
        "--num-layers-per-virtual-pipeline-stage ({}) must divide the layers of each "
        "pipeline rank (--num-layers {} / --pipeline-model-parallel-size {})",
        layers_per_chunk, m.num_layers, pp);
  const int chunks = per_rank / layers_per_chunk;
  if (given.virtual_pipeline > 1 && given.virtual_pipeline != chunks)
    refuse(
        "--num-layers-per-virtual-pipeline-stage ({}) gives {} virtual stages per rank but "
        "--virtual-pipeline-model-parallel-size is {}; give one of them",
        layers_per_chunk, chunks, given.virtual_pipeline);
}

// The schedule named as given exists, a single stage takes neither chunks nor uneven splits,
// and the derived plan's layer split and schedule can be made.
void check_pipeline(const ModelConfig& m, const ParallelPlan& given, const ParallelPlan& p) {
  if (!given.pipeline_scheduler.empty()) pipeline_schedule_kind(given);  // refuses unknown names
  if (p.pipeline_parallel == 1 &&
      (p.virtual_pipeline > 1 || p.first_stage_layers > 0 || p.last_stage_layers > 0))
    refuse(
        "virtual pipeline stages and uneven stage splits need --pipeline-model-parallel-size "
        "> 1");
  make_pipeline_layout(m, p);  // refuses splits and schedules it cannot make
}

// Megatron-LM's rules for the overlaps: the parameter gathers overlap only the distributed
// optimizer's, behind overlapped reductions; the materialised scores only beside the attention
// kernels that have them (context parallelism's ring and Ampipe's chunks run fused kernels).
void check_overlaps(const ModelConfig& m, const ParallelPlan& p) {
  if (p.overlap_param_gather && !(p.distributed_optimizer && p.overlap_grad_reduce))
    refuse(
        "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
        "(Megatron-LM asserts both): add them or drop it");
  if (p.tp_comm_overlap && p.tensor_parallel > 1 && !p.sequence_parallel)
    refuse(
        "--tp-comm-overlap overlaps sequence parallelism's all-gathers and reduce-scatters with "
        "the products, but --sequence-parallel is off with tensor parallelism {} (Megatron-LM "
        "asserts it): add --sequence-parallel or drop --tp-comm-overlap",
        p.tensor_parallel);
  if (p.tp_comm_overlap && p.ampipe_degree > 1)
    refuse(
        "--tp-comm-overlap splits the sequence-parallel collectives into pieces of each shard, "
        "but --ampipe-degree {} already splits them by its chunks and weave models one of the "
        "two: drop --tp-comm-overlap (--ampipe-tp-sp-comm-overlap is Ampipe's own overlap)",
        p.ampipe_degree);
  if (m.materialised_scores() && (p.context_parallel > 1 || p.ampipe_degree > 1))
    refuse(
        "--attention-backend {} materialises the scores, but context parallelism's ring and "
        "Ampipe's chunks run a fused attention kernel (Megatron-Core's and MindSpeed's need "
        "flash or fused there): use --attention-backend flash",
        attention_backend_name(m.attention_backend));
}

// ZeRO stage 2 reduces each layer's gradients once the micro-batch has written them all: after
// the layer's backward (Ampipe's too, its QKV weight half kept inside it), or a zero-bubble
// schedule's W action.
void check_sharded_gradients(const ParallelPlan& p) {
  if (p.zero_units_in_flight < 1)
    refuse(
        "--zero-units-in-flight {}: ZeRO stage 3 holds the layer computing at least, so the units "
        "in flight are at least 1 (2, the default, gathers the next layer under the current one)",
        p.zero_units_in_flight);
  if (p.zero_units_in_flight != 2 && !p.shard_parameters)
    refuse(
        "--zero-units-in-flight {} limits the layers whose parameters ZeRO stage 3 holds gathered "
        "at once; this run does not shard the parameters: give --zero-stage 3, or drop it",
        p.zero_units_in_flight);
  if (p.shard_parameters && !p.shard_gradients)
    refuse("sharding the parameters (ZeRO stage 3) shards the gradients too: give --zero-stage 3");
  if (p.shard_parameters && p.overlap_param_gather)
    refuse(
        "--overlap-param-gather gathers the distributed optimizer's updated shards at the next "
        "step's start; ZeRO stage 3 gathers each layer's before each use instead: drop it");
  if (!p.shard_gradients) return;
  if (!p.distributed_optimizer)
    refuse(
        "sharding the gradients (ZeRO stage 2) shards the optimizer state too: add "
        "--use-distributed-optimizer, or give --zero-stage 2");
}

// Ampipe's chunks need MoE layers to overlap with, and whole positions in every chunk.
void check_ampipe(const ModelConfig& m, const ParallelPlan& p) {
  require_positive("--ampipe-degree", p.ampipe_degree);
  check_flag_rules(p, {});  // the overlaps MindSpeed refuses beside Ampipe
  const int degree = p.ampipe_degree, tp = p.tensor_parallel, cp = p.context_parallel;
  const int sp = p.sequence_parallel ? tp : 1;
  if (degree == 1) return;
  if (m.num_experts == 0)
    refuse(
        "--ampipe-degree ({}) pipelines attention with MoE all-to-alls and needs MoE "
        "layers: set --num-experts",
        degree);
  if (tp > 1 && sp == 1 && cp > 1)
    refuse(
        "--ampipe-degree ({}) with --tensor-model-parallel-size {} and --context-parallel-size "
        "{} needs --sequence-parallel: weave splits the ring's chunks over the tensor-parallel "
        "ranks as sequence-parallel pieces only",
        degree, tp, cp);
  if (cp > 1 && degree != 2)
    refuse(
        "--ampipe-degree must be 2 with --context-parallel-size {} (got {}): the two "
        "chunks are the two load-balanced halves each rank holds",
        cp, degree);
  if (degree > m.seq_length)
    refuse("--ampipe-degree ({}) must not exceed --seq-length ({}): every chunk needs positions",
           degree, m.seq_length);
  // MindSpeed's rules: S % (N tp) with SP; under CP S % (2 N cp), and (S / (2 N cp)) % tp.
  // Without SP weave's rule, S % (N tp): each tp rank routes its own slice of every chunk
  // (Megatron-Core's router); MindSpeed's gate routes every chunk whole on each tp rank.
  const bool slices = sp == 1 && tp > 1 && m.moe_gate != MoeGate::deepspeed;
  const int split = cp > 1 ? sp : slices ? tp : sp;
  const long long unit = 1LL * (cp > 1 ? 2 * degree * cp : degree) * split;
  if (m.seq_length % unit != 0)
    refuse(
        "--seq-length ({}) must be divisible by {} under --ampipe-degree {}: every "
        "sequence chunk{} needs whole positions ({})",
        m.seq_length, unit, degree,
        sp > 1   ? " is split again over the sequence-parallel ranks and"
        : slices ? " is split again over the tensor-parallel ranks' routers and"
                 : "",
        slices             ? "weave routes each tp rank's slice of a chunk"
        : sp > 1 || cp > 1 ? "MindSpeed's rule"
                           : "the chunks are equal");
}

// --use-pipe-experts as given needs experts; as derived (still on), no more capacity slices
// than an expert takes tokens.
void check_pipe_experts(const ModelConfig& m, const ParallelPlan& given, const ParallelPlan& p) {
  require_positive("--pipe-experts-multi-data", given.pipe_experts_multi_data);
  if (given.pipe_experts && m.num_experts == 0)
    refuse("--use-pipe-experts pipelines MoE experts: set --num-experts");
  if (!p.pipe_experts || !(m.moe_expert_capacity_factor > 0)) return;
  const int degree = p.ampipe_degree, slices = p.pipe_experts_multi_data;
  const double capacity = expert_capacity_per_chunk(m, p);
  if (slices / degree > capacity)
    refuse(
        "--pipe-experts-multi-data ({}) / --ampipe-degree ({}) slices must not exceed an "
        "expert's capacity ({:.0f} picks per chunk at --moe-expert-capacity-factor {})",
        slices, degree, capacity, m.moe_expert_capacity_factor);
}

void check_dropout_and_norm(const ModelConfig& m) {
  if (m.hidden_dropout < 0 || m.hidden_dropout >= 1)
    refuse("--hidden-dropout must be in [0, 1), got {}", m.hidden_dropout);
  if (m.attention_dropout < 0 || m.attention_dropout >= 1)
    refuse("--attention-dropout must be in [0, 1), got {}", m.attention_dropout);
  if (!(m.layernorm_epsilon > 0)) refuse("--norm-epsilon must be > 0, got {}", m.layernorm_epsilon);
}

// --fp32-residual-connection widens a 16-bit run's residual stream: an fp32 run's is fp32 already,
// and Megatron-LM asserts --fp16 or --bf16 with it (megatron/training/arguments.py).
void check_residual_precision(const ModelConfig& m) {
  if (m.fp32_residual_connection && m.precision == Precision::fp32)
    refuse(
        "--fp32-residual-connection keeps a 16-bit run's residual stream in fp32, and this run is "
        "fp32: give --bf16 or --fp16 with it, or leave it out (Megatron-LM refuses it too)");
}

// Grouped-query attention: whole key/value heads per query group and per tensor-parallel rank.
void check_query_groups(const ModelConfig& m, const ParallelPlan& p) {
  if (m.num_query_groups < 0 ||
      (m.num_query_groups > 0 && m.num_attention_heads % m.num_query_groups != 0))
    refuse(
        "--num-query-groups ({}) must divide --num-attention-heads ({}): every key/value head "
        "serves the same number of query heads",
        m.num_query_groups, m.num_attention_heads);
  if (m.query_groups() % p.tensor_parallel != 0)
    refuse(
        "--num-query-groups ({}) must be divisible by --tensor-model-parallel-size ({}): each "
        "tensor-parallel rank holds whole key/value heads with their query heads",
        m.query_groups(), p.tensor_parallel);
}

// The modules weave recomputes selectively, by Megatron-Core's names (TransformerConfig's
// recompute_modules): core_attn (which its blockwise attention recomputes in every backward
// already), mlp, layernorm, moe_act and moe. Each shares one working set per rank, which the
// next recomputation of the same module writes again: what reads it must run before that.
void check_selective_recomputation(const ModelConfig& m, const ParallelPlan& p) {
  const Recompute& r = m.recompute;
  const ScheduleKind kind = pipeline_schedule_kind(p);
  const bool zero_bubble = kind == ScheduleKind::ZeroBubbleH1 || kind == ScheduleKind::ZeroBubbleV;
  if (r.recomputes(kRecomputeMoe) && zero_bubble)
    refuse(
        "--recompute-modules moe is not done with --pipeline-scheduler {}: its W actions compute "
        "the experts' weight gradients after the input gradients, from the MoE state the next "
        "recomputed MoE layer has written over by then. Choose --pipeline-scheduler 1f1b or "
        "interleaved, or drop moe",
        schedule_name(kind));
  if (r.recomputes(kRecomputeMoe) && p.ampipe_degree > 1)
    refuse(
        "--recompute-modules moe is not done with --ampipe-degree {}: Ampipe pipelines its MoE "
        "layers' chunks with their attention, which a recomputed MoE layer alone cannot run "
        "again. Drop moe (recompute whole layers with --recompute-granularity full), or set "
        "--ampipe-degree 1",
        p.ampipe_degree);
  if (r.recomputes(kRecomputeMlp) && zero_bubble)
    refuse(
        "--recompute-modules mlp is not done with --pipeline-scheduler {}: its W actions compute "
        "the MLP's weight gradients after its input gradient, from activations the recomputed "
        "MLP hands to the next one. Choose --pipeline-scheduler 1f1b or interleaved, or drop mlp",
        schedule_name(kind));
  if (r.recomputes(kRecomputeLayerNorm) && zero_bubble)
    refuse(
        "--recompute-modules layernorm is not done with --pipeline-scheduler {}: its W actions "
        "compute QKV's and fc1's weight gradients after the input gradients, from the norms' "
        "outputs, which the next layer's recomputed norm has written over by then. Choose "
        "--pipeline-scheduler 1f1b or interleaved, or drop layernorm",
        schedule_name(kind));
  if (r.recomputes(kRecomputeLayerNorm) && p.ampipe_degree > 1)
    refuse(
        "--recompute-modules layernorm is not done with --ampipe-degree {}: Ampipe computes its "
        "layers' norms chunk by chunk inside its pipelined attention and MLP, which keep them. "
        "Drop layernorm, or set --ampipe-degree 1",
        p.ampipe_degree);
  if (r.recomputes(kRecomputeMoeActivation) && (plan_pipes_experts(p) || plan_overlaps_tp_sp(p)))
    refuse(
        "--recompute-modules moe_act is not done with {}: its expert items run their activation "
        "and fc2 in tasks of their own (on streams of their own with "
        "--pipe-experts-separate-streams), each keeping its rows of the hidden layer for the "
        "next. Drop moe_act, or leave out {}",
        plan_pipes_experts(p) ? "--use-pipe-experts" : "--ampipe-tp-sp-comm-overlap",
        plan_pipes_experts(p) ? "--use-pipe-experts" : "--ampipe-tp-sp-comm-overlap");
}

// Megatron-LM's rules for activation recomputation (TransformerConfig's checks): full needs a
// method and a layer count of 1 to the layers of a pipeline rank; selective takes neither.
void check_recomputation(const ModelConfig& m, const ParallelPlan& p) {
  const Recompute& r = m.recompute;
  const bool method = r.method != RecomputeMethod::none;
  switch (r.granularity) {
    case RecomputeGranularity::none:
      if (method || r.num_layers != 0)
        refuse(
            "--recompute-method and --recompute-num-layers apply with --recompute-granularity "
            "full (Megatron-LM's rule): add --recompute-granularity full, or drop them");
      if (r.modules != 0)
        refuse(
            "--recompute-modules names what --recompute-granularity selective recomputes "
            "(Megatron-LM ignores it otherwise): add --recompute-granularity selective, or drop "
            "it");
      return;
    case RecomputeGranularity::selective:
      if (method || r.num_layers != 0)
        refuse(
            "--recompute-granularity selective recomputes the core attention of every layer and "
            "takes no --recompute-method or --recompute-num-layers (Megatron-LM's rule): drop "
            "them, or use --recompute-granularity full");
      check_selective_recomputation(m, p);
      return;
    case RecomputeGranularity::full:
      break;
  }
  if (r.modules != 0)
    refuse(
        "--recompute-modules names what --recompute-granularity selective recomputes "
        "(Megatron-LM ignores it otherwise); --recompute-granularity full recomputes whole "
        "layers: drop one of them");
  if (!method)
    refuse(
        "--recompute-granularity full needs --recompute-method uniform or block (Megatron-LM's "
        "rule): uniform recomputes groups of --recompute-num-layers layers, block the first "
        "--recompute-num-layers layers of each model chunk");
  const int per_rank = m.num_layers / p.pipeline_parallel;
  if (r.num_layers < 1 || r.num_layers > per_rank)
    refuse(
        "--recompute-num-layers must be between 1 and the layers of a pipeline rank ({} = "
        "--num-layers {} / --pipeline-model-parallel-size {}) with --recompute-granularity full "
        "(Megatron-LM's rule), got {}",
        per_rank, m.num_layers, p.pipeline_parallel, r.num_layers);
  const ScheduleKind kind = pipeline_schedule_kind(p);
  if (kind == ScheduleKind::ZeroBubbleH1 || kind == ScheduleKind::ZeroBubbleV)
    refuse(
        "--recompute-granularity full is not done with --pipeline-scheduler {}: its W actions "
        "compute the weight gradients after the input gradients, from the activations a "
        "recomputed layer frees for the next recomputed layer as soon as its input gradient is "
        "done. Choose --pipeline-scheduler 1f1b or interleaved, or drop --recompute-granularity",
        schedule_name(kind));
}

void check_rotary_embedding(const ModelConfig& m) {
  if (m.position_embedding != PositionEmbedding::rope) return;
  if (!(m.rotary_percent > 0 && m.rotary_percent <= 1))
    refuse("--rotary-percent must be in (0, 1], got {}", m.rotary_percent);
  if (!(m.rotary_base > 0)) refuse("--rotary-base must be > 0, got {}", m.rotary_base);
  if (m.rotary_dims() < 2)
    refuse(
        "--rotary-percent {} of a head's {} dimensions{} rotates {}: RoPE needs at least 2 "
        "(raise --rotary-percent{})",
        m.rotary_percent, m.head_dim(), m.kv_channels > 0 ? " (--kv-channels)" : "",
        m.rotary_dims(), m.kv_channels > 0 ? " or --kv-channels" : "");
}

}  // namespace

void check_plan_rules(const ModelConfig& m, const ParallelPlan& given,
                      const ParallelPlan& derived) {
  check_sizes_are_positive(m, derived);
  check_sizes_fit(m, derived);
  check_tensor_parallel(m, derived);
  check_position_embeddings(m);
  check_sequence_parallel(m, derived);
  check_context_parallel(m, derived);
  check_moe_model(m, derived);
  check_shared_experts(m, derived);
  check_moe_model_type(given);
  check_moe_gate(m, derived);
  check_load_balancing(m, derived);
  check_expert_tensor_parallel(m, derived);
  check_expert_parallel_groups(derived);
  check_global_batch(derived);
  check_virtual_stages(m, given);
  check_pipeline(m, given, derived);
  check_ampipe(m, derived);
  check_overlaps(m, derived);
  check_sharded_gradients(derived);
  check_pipe_experts(m, given, derived);
  check_dropout_and_norm(m);
  check_residual_precision(m);
  check_query_groups(m, derived);
  require_positive("--vocab-size", m.vocab_size);
  check_recomputation(m, derived);
  check_rotary_embedding(m);
}

}  // namespace weave::graphs
