#include "weave/graphs/parallel_plan.hpp"

#include "weave/graphs/pipeline_layout.hpp"

#include <fmt/format.h>

#include <cmath>

namespace weave::graphs {

const char* position_embedding_name(PositionEmbedding p) {
  switch (p) {
    case PositionEmbedding::learned_absolute:
      return "learned_absolute";
    case PositionEmbedding::rope:
      return "rope";
    case PositionEmbedding::none:
      break;
  }
  return "none";
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::bf16:
      return "bf16";
    case Precision::fp16:
      return "fp16";
    case Precision::fp32:
      break;
  }
  return "fp32";
}

ParameterBytes parameter_bytes(Precision p) {
  switch (p) {
    case Precision::bf16:  // bf16 weights, fp32 gradients; fp32 master weights and moments
      return {.parameter = 2, .gradient = 4, .optimizer_state = 12};
    case Precision::fp16:  // fp16 weights and gradients; fp32 master weights, gradients, moments
      return {.parameter = 2, .gradient = 2, .optimizer_state = 16};
    case Precision::fp32:
      break;
  }
  return {.parameter = 4, .gradient = 4, .optimizer_state = 8};
}

int ModelConfig::padded_vocab_size(int tensor_parallel) const {
  const int multiple = make_vocab_size_divisible_by * tensor_parallel;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

namespace {

template <typename... Args>
[[noreturn]] void refuse(fmt::format_string<Args...> format, Args&&... args) {
  throw ConfigError(fmt::format(format, std::forward<Args>(args)...));
}

void require_positive(const char* flag, long long value) {
  if (value < 1) refuse("{} must be >= 1, got {}", flag, value);
}

// Megatron-LM's rules for activation recomputation (TransformerConfig's checks): full needs a
// method and a layer count of 1 to the layers of a pipeline rank; selective takes neither.
void validate_recompute(const ModelConfig& m, const ParallelPlan& p) {
  const Recompute& r = m.recompute;
  const bool method = r.method != RecomputeMethod::none;
  switch (r.granularity) {
    case RecomputeGranularity::none:
      if (method || r.num_layers != 0)
        refuse(
            "--recompute-method and --recompute-num-layers apply with --recompute-granularity "
            "full (Megatron-LM's rule): add --recompute-granularity full, or drop them");
      return;
    case RecomputeGranularity::selective:
      if (method || r.num_layers != 0)
        refuse(
            "--recompute-granularity selective recomputes the core attention of every layer and "
            "takes no --recompute-method or --recompute-num-layers (Megatron-LM's rule): drop "
            "them, or use --recompute-granularity full");
      return;
    case RecomputeGranularity::full:
      break;
  }
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
}

}  // namespace

std::vector<std::string> validate(const ModelConfig& m, ParallelPlan& p) {
  std::vector<std::string> warnings;
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
  const int tp = p.tensor_parallel, cp = p.context_parallel, dp = p.data_parallel;
  if (m.hidden_size % m.num_attention_heads != 0)
    refuse(
        "--hidden-size ({}) must be divisible by --num-attention-heads ({}): every head has "
        "hidden / heads dimensions",
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
  if (m.positions() < m.seq_length)
    refuse("--max-position-embeddings ({}) must be >= --seq-length ({})", m.positions(),
           m.seq_length);
  if (p.sequence_parallel && tp == 1) {
    p.sequence_parallel = false;
    warnings.push_back(
        "--sequence-parallel has no effect with --tensor-model-parallel-size 1 and is switched "
        "off (as Megatron-LM does)");
  }
  if (p.sequence_parallel && m.seq_length % tp != 0)
    refuse(
        "--seq-length ({}) must be divisible by --tensor-model-parallel-size ({}) under "
        "--sequence-parallel: each rank holds seq/tp positions",
        m.seq_length, tp);
  const int sp = p.sequence_parallel ? tp : 1;
  if (cp > 1 && m.seq_length % (2 * cp * sp) != 0)
    refuse(
        "--seq-length ({}) must be divisible by 2 x --context-parallel-size{} ({}): the "
        "sequence is cut into 2 x cp load-balanced chunks{}",
        m.seq_length, sp > 1 ? " x --tensor-model-parallel-size" : "", 2 * cp * sp,
        sp > 1 ? ", each split again over the sequence-parallel ranks" : "");
  if (m.num_experts < 0) refuse("--num-experts must be >= 0, got {}", m.num_experts);
  if (m.num_experts > 0) {
    require_positive("--moe-layer-freq", m.moe_layer_freq);
    if (m.moe_router_topk < 1 || m.moe_router_topk > m.num_experts)
      refuse("--moe-router-topk ({}) must be between 1 and --num-experts ({})", m.moe_router_topk,
             m.num_experts);
    if (m.num_experts % p.expert_parallel != 0)
      refuse(
          "--num-experts ({}) must be divisible by --expert-model-parallel-size ({}): each "
          "expert-parallel rank holds the same number of experts",
          m.num_experts, p.expert_parallel);
    if (m.moe_expert_capacity_factor < 0)
      refuse("--moe-expert-capacity-factor must be >= 0 (0: dropless), got {}",
             m.moe_expert_capacity_factor);
  } else if (p.expert_parallel > 1) {
    refuse("--expert-model-parallel-size ({}) needs --num-experts > 0", p.expert_parallel);
  }
  if (p.moe_model_type == "deepspeed_moe") {
    if (p.expert_tensor_parallel != 1 && p.expert_tensor_parallel != tp)
      refuse(
          "--moe-model-type deepspeed_moe splits every expert over the tensor-parallel group: "
          "--expert-tensor-parallel-size ({}) must be --tensor-model-parallel-size ({}) or unset",
          p.expert_tensor_parallel, tp);
    p.expert_tensor_parallel = tp;
  } else if (!p.moe_model_type.empty() && p.moe_model_type != "megatron") {
    refuse("--moe-model-type must be megatron or deepspeed_moe, got '{}'", p.moe_model_type);
  }
  require_positive("--expert-tensor-parallel-size", p.expert_tensor_parallel);
  if (p.expert_tensor_parallel != 1 && p.expert_tensor_parallel != tp)
    refuse(
        "--expert-tensor-parallel-size ({}) must be 1 (every expert whole on one rank) or "
        "--tensor-model-parallel-size ({}) (every expert split over the tensor-parallel group)",
        p.expert_tensor_parallel, tp);
  if (p.expert_tensor_parallel > 1 && m.num_experts == 0)
    refuse("--expert-tensor-parallel-size ({}) splits experts: set --num-experts",
           p.expert_tensor_parallel);
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
  if (const long long per_step = 1LL * p.micro_batch_size * dp; p.global_batch_size % per_step != 0)
    refuse(
        "--global-batch-size ({}) must be divisible by --micro-batch-size x data-parallel size "
        "({} x {} = {})",
        p.global_batch_size, p.micro_batch_size, dp, per_step);
  require_positive("--virtual-pipeline-model-parallel-size", p.virtual_pipeline);
  if (p.layers_per_virtual_stage < 0)
    refuse("--num-layers-per-virtual-pipeline-stage must be >= 1, got {}",
           p.layers_per_virtual_stage);
  if (p.layers_per_virtual_stage > 0) {
    const int per_rank = m.num_layers / p.pipeline_parallel;
    if (m.num_layers % p.pipeline_parallel != 0 || per_rank % p.layers_per_virtual_stage != 0)
      refuse(
          "--num-layers-per-virtual-pipeline-stage ({}) must divide the layers of each "
          "pipeline rank (--num-layers {} / --pipeline-model-parallel-size {})",
          p.layers_per_virtual_stage, m.num_layers, p.pipeline_parallel);
    const int v = per_rank / p.layers_per_virtual_stage;
    if (p.virtual_pipeline > 1 && p.virtual_pipeline != v)
      refuse(
          "--num-layers-per-virtual-pipeline-stage ({}) gives {} virtual stages per rank but "
          "--virtual-pipeline-model-parallel-size is {}; give one of them",
          p.layers_per_virtual_stage, v, p.virtual_pipeline);
    p.virtual_pipeline = v;
  }
  const bool v_shape =
      !p.pipeline_scheduler.empty() && pipeline_schedule_kind(p) == ScheduleKind::ZeroBubbleV;
  if (v_shape && p.virtual_pipeline == 1 && p.pipeline_parallel > 1)
    p.virtual_pipeline = 2;  // zb-v's two chunks per rank
  if (p.pipeline_parallel == 1 && (p.virtual_pipeline > 1 || !p.pipeline_scheduler.empty() ||
                                   p.first_stage_layers > 0 || p.last_stage_layers > 0)) {
    if (p.virtual_pipeline > 1 || p.first_stage_layers > 0 || p.last_stage_layers > 0)
      refuse(
          "virtual pipeline stages and uneven stage splits need --pipeline-model-parallel-size "
          "> 1");
    warnings.push_back(
        fmt::format("--pipeline-scheduler {} has no effect with --pipeline-model-parallel-size 1",
                    p.pipeline_scheduler));
    p.pipeline_scheduler.clear();
  }
  make_pipeline_layout(m, p);  // refuses splits and schedules it cannot make
  require_positive("--ampipe-degree", p.ampipe_degree);
  if (p.ampipe_degree > 1) {
    const int degree = p.ampipe_degree;
    if (m.num_experts == 0)
      refuse(
          "--ampipe-degree ({}) pipelines attention with MoE all-to-alls and needs MoE "
          "layers: set --num-experts",
          degree);
    if (p.tensor_parallel > 1 && sp == 1)
      refuse(
          "--ampipe-degree ({}) with --tensor-model-parallel-size {} needs --sequence-parallel: "
          "each tensor-parallel rank routes its own piece of every chunk",
          degree, p.tensor_parallel);
    if (cp > 1 && degree != 2)
      refuse(
          "--ampipe-degree must be 2 with --context-parallel-size {} (got {}): the two "
          "chunks are the two load-balanced halves each rank holds",
          cp, degree);
    if (degree > m.seq_length)
      refuse("--ampipe-degree ({}) must not exceed --seq-length ({}): every chunk needs positions",
             degree, m.seq_length);
    // MindSpeed's rules: S % (N tp) with SP; under CP S % (2 N cp), and (S / (2 N cp)) % tp.
    const long long unit = 1LL * (cp > 1 ? 2 * degree * cp : degree) * sp;
    if (m.seq_length % unit != 0)
      refuse(
          "--seq-length ({}) must be divisible by {} under --ampipe-degree {}: every "
          "sequence chunk{} needs whole positions (MindSpeed's rule)",
          m.seq_length, unit, degree,
          sp > 1 ? " is split again over the sequence-parallel ranks and" : "");
    if (p.expert_parallel == 1)
      warnings.push_back(fmt::format(
          "--ampipe-degree {} with --expert-model-parallel-size 1 has no all-to-all to hide; "
          "MindSpeed refuses it (EP > 1), weave runs it (the chunks are exact either way)",
          degree));
  }
  if (p.ampipe_tp_sp_comm_overlap) {
    // It pipelines the split experts' all-gathers and reduce-scatters over (chunk, expert) items.
    std::string why;
    if (p.ampipe_degree < 2)
      why = "it pipelines Ampipe's chunks: set --ampipe-degree >= 2";
    else if (p.expert_tensor_parallel < 2 || tp < 2)
      why =
          "it pipelines the experts' tensor-parallel all-gathers and reduce-scatters, and the "
          "experts are whole: set --moe-model-type deepspeed_moe (or --expert-tensor-parallel-size "
          "= --tensor-model-parallel-size) with --tensor-model-parallel-size > 1";
    else if (!p.sequence_parallel)
      why = "it needs --sequence-parallel (MindSpeed's rule)";
    else if (p.expert_parallel < 2)
      why = "with --expert-model-parallel-size 1 there are no all-to-alls to pipeline with";
    if (!why.empty()) {
      p.ampipe_tp_sp_comm_overlap = false;
      warnings.push_back("--ampipe-tp-sp-comm-overlap is switched off: " + why);
    }
  }
  if (p.ampipe_cp_resend_kv && (p.ampipe_degree < 2 || cp < 2)) {
    p.ampipe_cp_resend_kv = false;
    warnings.push_back(
        "--ampipe-cp-resend-kv has no effect without --ampipe-degree 2 and "
        "--context-parallel-size > 1: only Ampipe's chunks under CP keep every key/value block");
  } else if (p.ampipe_cp_resend_kv && p.pipeline_parallel == 1) {
    // Each MoE layer frees cp - 1 blocks; the forward's and the backward's rings hold cp - 1 each.
    int moe_layers = 0;
    for (int l = 0; l < m.num_layers; ++l)
      moe_layers += m.is_moe_layer(l) ? 1 : 0;
    if (moe_layers <= 2)
      warnings.push_back(fmt::format(
          "--ampipe-cp-resend-kv saves no memory with {} MoE layer{} and no pipeline: each keeps "
          "cp - 1 key/value blocks fewer, and the two rings' workspaces hold 2 (cp - 1); it pays "
          "from 3 MoE layers a stage",
          moe_layers, moe_layers == 1 ? "" : "s"));
  }
  require_positive("--pipe-experts-multi-data", p.pipe_experts_multi_data);
  if (p.pipe_experts && p.pipe_experts_multi_stream &&
      !(p.sequence_parallel && p.expert_tensor_parallel > 1)) {
    // It chains the experts' all-to-alls with their tensor-parallel gathers and scatters.
    p.pipe_experts_multi_stream = false;
    warnings.push_back(
        "--pipe-experts-multi-stream is switched off: it chains the items' all-to-alls with the "
        "split experts' tensor-parallel all-gathers and reduce-scatters, and needs "
        "--sequence-parallel with --moe-model-type deepspeed_moe (MindSpeed's rule); "
        "--pipe-experts-separate-streams gives dispatches and combines streams of their own");
  }
  if (p.pipe_experts) {
    const int degree = p.ampipe_degree, slices = p.pipe_experts_multi_data;
    auto switch_off = [&](const std::string& why) {
      p.pipe_experts = p.pipe_experts_multi_stream = p.pipe_experts_separate_streams = false;
      p.pipe_experts_multi_data = 1;
      warnings.push_back("--use-pipe-experts is switched off: " + why);
    };
    if (m.num_experts == 0) refuse("--use-pipe-experts pipelines MoE experts: set --num-experts");
    const int local = p.expert_parallel > 0 ? m.num_experts / p.expert_parallel : 1;
    if (p.expert_parallel == 1) {
      switch_off("with --expert-model-parallel-size 1 there is no all-to-all to overlap");
    } else if (slices % degree != 0) {
      switch_off(fmt::format(
          "--pipe-experts-multi-data ({}) must be divisible by --ampipe-degree ({}) (MindSpeed's "
          "rule)",
          slices, degree));
    } else if (degree > 1 &&
               !(slices > degree || (slices == degree && p.pipe_experts_multi_stream))) {
      switch_off(fmt::format(
          "with --ampipe-degree {} it needs --pipe-experts-multi-data > {} (or = {} with "
          "--pipe-experts-multi-stream), got {} (MindSpeed's rule)",
          degree, degree, degree, slices));
    } else if (m.moe_expert_capacity_factor > 0) {
      // Each slot routes S / (cp tp) x B / degree tokens; an expert takes ceil(f n k / E).
      const double n = static_cast<double>(m.seq_length) / (cp * tp) * p.micro_batch_size / degree;
      // Compared as a double: a huge capacity factor gives a capacity no integer holds.
      const double capacity =
          std::ceil(m.moe_expert_capacity_factor * n * m.moe_router_topk / m.num_experts);
      if (slices / degree > capacity)
        refuse(
            "--pipe-experts-multi-data ({}) / --ampipe-degree ({}) slices must not exceed an "
            "expert's capacity ({:.0f} picks per chunk at --moe-expert-capacity-factor {})",
            slices, degree, capacity, m.moe_expert_capacity_factor);
    }
    if (p.pipe_experts && local == 1 && slices / degree == 1) {
      switch_off(fmt::format(
          "one local expert ({} experts over {} expert-parallel ranks) and one capacity slice "
          "leave a single item: raise --pipe-experts-multi-data",
          m.num_experts, p.expert_parallel));
    }
  } else if (p.pipe_experts_multi_stream || p.pipe_experts_separate_streams ||
             p.pipe_experts_multi_data > 1) {
    warnings.push_back(
        "--pipe-experts-multi-stream, --pipe-experts-separate-streams and "
        "--pipe-experts-multi-data apply with --use-pipe-experts and are ignored without it");
    p.pipe_experts_multi_stream = p.pipe_experts_separate_streams = false;
    p.pipe_experts_multi_data = 1;
  }
  if (m.hidden_dropout < 0 || m.hidden_dropout >= 1)
    refuse("--hidden-dropout must be in [0, 1), got {}", m.hidden_dropout);
  if (m.attention_dropout < 0 || m.attention_dropout >= 1)
    refuse("--attention-dropout must be in [0, 1), got {}", m.attention_dropout);
  if (!(m.layernorm_epsilon > 0)) refuse("--norm-epsilon must be > 0, got {}", m.layernorm_epsilon);
  if (m.num_query_groups < 0 ||
      (m.num_query_groups > 0 && m.num_attention_heads % m.num_query_groups != 0))
    refuse(
        "--num-query-groups ({}) must divide --num-attention-heads ({}): every key/value head "
        "serves the same number of query heads",
        m.num_query_groups, m.num_attention_heads);
  if (m.query_groups() % tp != 0)
    refuse(
        "--num-query-groups ({}) must be divisible by --tensor-model-parallel-size ({}): each "
        "tensor-parallel rank holds whole key/value heads with their query heads",
        m.query_groups(), tp);
  require_positive("--vocab-size", m.vocab_size);
  validate_recompute(m, p);
  if (m.position_embedding == PositionEmbedding::rope) {
    if (!(m.rotary_percent > 0 && m.rotary_percent <= 1))
      refuse("--rotary-percent must be in (0, 1], got {}", m.rotary_percent);
    if (!(m.rotary_base > 0)) refuse("--rotary-base must be > 0, got {}", m.rotary_base);
    if (m.rotary_dims() < 2)
      refuse(
          "--rotary-percent {} of a head's {} dimensions rotates {}: RoPE needs at least 2 "
          "(raise --rotary-percent)",
          m.rotary_percent, m.head_dim(), m.rotary_dims());
  }
  return warnings;
}

}  // namespace weave::graphs
