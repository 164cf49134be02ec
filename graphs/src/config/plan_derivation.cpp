#include "config/plan_derivation.hpp"

#include <fmt/format.h>

#include <cmath>

#include "weave/graphs/pipeline_schedule_generators.hpp"

namespace weave::graphs {

namespace {

using Warnings = std::vector<std::string>;

// Megatron-LM switches sequence parallelism off at tp = 1: there is no group to split over.
void switch_off_sequence_parallel_without_tensor_parallel(ParallelPlan& p, Warnings& warnings) {
  if (!p.sequence_parallel || p.tensor_parallel != 1) return;
  p.sequence_parallel = false;
  warnings.push_back(
      "--sequence-parallel has no effect with --tensor-model-parallel-size 1 and is switched "
      "off (as Megatron-LM does)");
}

// MindSpeed's deepspeed_moe layout splits every expert over the tensor-parallel group. An
// --expert-tensor-parallel-size that contradicts it is refused from the value as given.
void split_experts_for_deepspeed_moe(ParallelPlan& p) {
  if (p.moe_model_type == "deepspeed_moe") p.expert_tensor_parallel = p.tensor_parallel;
}

// Model chunks per pipeline rank: from --num-layers-per-virtual-pipeline-stage when it divides
// each rank's layers (a conflicting --virtual-pipeline-model-parallel-size is refused from the
// value as given), and two for zb-v's V when nothing else gives a count.
void derive_virtual_stages(const ModelConfig& m, ParallelPlan& p) {
  const int pp = p.pipeline_parallel, layers_per_chunk = p.layers_per_virtual_stage;
  if (layers_per_chunk > 0 && pp >= 1 && m.num_layers % pp == 0 &&
      m.num_layers / pp % layers_per_chunk == 0)
    p.virtual_pipeline = m.num_layers / pp / layers_per_chunk;
  const bool v_shape = p.pipeline_scheduler == schedule_name(ScheduleKind::ZeroBubbleV);
  if (v_shape && p.virtual_pipeline == 1 && pp > 1) p.virtual_pipeline = 2;
}

// Without a pipeline there is no schedule to choose.
void drop_scheduler_without_pipeline(ParallelPlan& p, Warnings& warnings) {
  if (p.pipeline_parallel != 1 || p.pipeline_scheduler.empty()) return;
  warnings.push_back(
      fmt::format("--pipeline-scheduler {} has no effect with --pipeline-model-parallel-size 1",
                  p.pipeline_scheduler));
  p.pipeline_scheduler.clear();
}

std::string why_pipe_experts_cannot_apply(const ModelConfig& m, const ParallelPlan& p);

// Whether --use-pipe-experts stays on beside Ampipe with whole experts (tp 1 under MindSpeed's
// layout), where the multi-stream option is switched off (it needs SP and split experts).
bool pipes_whole_experts_under_ampipe(const ModelConfig& m, const ParallelPlan& p) {
  const bool whole = p.expert_tensor_parallel < 2 || p.tensor_parallel < 2;
  if (!p.pipe_experts || !whole || m.num_experts < 1 || p.expert_parallel < 1) return false;
  ParallelPlan single_stream = p;
  single_stream.pipe_experts_multi_stream = false;
  return why_pipe_experts_cannot_apply(m, single_stream).empty();
}

// MindSpeed's arguments.py asserts these beside Ampipe, and its code fails where it hands whole
// experts to PipeExpert; weave's chunks are exact without them, so a run that breaks them is
// kept and the difference named, in one warning.
void warn_ampipe_beyond_mindspeeds_rules(const ModelConfig& m, const ParallelPlan& p,
                                         Warnings& warnings) {
  if (p.ampipe_degree <= 1) return;
  std::vector<std::string> broken;
  if (p.expert_parallel == 1)
    broken.emplace_back(
        "--expert-model-parallel-size 1 has no all-to-all to hide: MindSpeed refuses it (EP > "
        "1), weave runs it");
  if (m.num_experts > 0 && p.moe_model_type != "deepspeed_moe")
    broken.emplace_back(
        "MindSpeed's Ampipe needs --moe-model-type deepspeed_moe (its gate, experts split "
        "over tp), weave also runs Megatron-Core's router, its experts whole or split by "
        "--expert-tensor-parallel-size");
  if (m.add_bias_linear)
    broken.emplace_back(
        "MindSpeed's Ampipe refuses biased linear layers (add --disable-bias-linear), weave "
        "runs them");
  // ampipe_moe_mlp_computer.py hands PipeExpert the items when --pipe-experts-multi-data exceeds
  // the degree; ampipe_async_communication.py splits the all-to-alls into (expert, slice) items
  // only under --ampipe-tp-sp-comm-overlap, which weave keeps for split experts only.
  if (pipes_whole_experts_under_ampipe(m, p))
    broken.emplace_back(fmt::format(
        "--use-pipe-experts with whole experts (tp 1 under MindSpeed's deepspeed_moe): "
        "MindSpeed's PipeExpert runs them expert-major only under --ampipe-tp-sp-comm-overlap "
        "(which weave switches off for whole experts); without it MindSpeed hands PipeExpert "
        "each chunk's whole all-to-all, runs its first local expert on every local expert's "
        "rows and stops with an IndexError after {} of its {} slices; weave runs each chunk's "
        "items in turn, chunk-major",
        p.ampipe_degree, p.pipe_experts_multi_data));
  if (broken.empty()) return;
  warnings.push_back(
      fmt::format("--ampipe-degree {} where MindSpeed's Ampipe stops (the chunks "
                  "are exact either way): {}",
                  p.ampipe_degree, fmt::join(broken, "; ")));
}

// It pipelines the split experts' tensor-parallel collectives over (chunk, expert) items, with
// or without SP: what the plan lacks for that, or "" when nothing is missing.
std::string missing_for_ampipe_tp_sp_comm_overlap(const ParallelPlan& p) {
  if (p.ampipe_degree < 2) return "it pipelines Ampipe's chunks: set --ampipe-degree >= 2";
  if (p.expert_tensor_parallel < 2 || p.tensor_parallel < 2)
    return "it pipelines the experts' tensor-parallel all-gathers and reduce-scatters, and the "
           "experts are whole: set --moe-model-type deepspeed_moe (or "
           "--expert-tensor-parallel-size "
           "= --tensor-model-parallel-size) with --tensor-model-parallel-size > 1";
  if (p.expert_parallel < 2)
    return "with --expert-model-parallel-size 1 there are no all-to-alls to pipeline with";
  return "";
}

void switch_off_ampipe_tp_sp_comm_overlap(ParallelPlan& p, Warnings& warnings) {
  if (!p.ampipe_tp_sp_comm_overlap) return;
  const std::string missing = missing_for_ampipe_tp_sp_comm_overlap(p);
  if (missing.empty()) return;
  p.ampipe_tp_sp_comm_overlap = false;
  warnings.push_back("--ampipe-tp-sp-comm-overlap is switched off: " + missing);
}

// The layers ModelConfig::is_moe_layer picks: the pattern's ones, or 0, freq, 2 freq, ...
// counted without a loop over --num-layers; 0 when --num-experts or --moe-layer-freq breaks its
// rule.
int moe_layer_count(const ModelConfig& m) {
  if (m.num_experts <= 0 || m.num_layers < 1) return 0;
  if (!m.moe_layer_pattern.empty()) {
    int count = 0;
    for (const int moe : m.moe_layer_pattern)
      count += moe == 1 ? 1 : 0;
    return count;
  }
  if (m.moe_layer_freq < 1) return 0;
  return (m.num_layers - 1) / m.moe_layer_freq + 1;
}

// Only Ampipe's chunks under CP keep every key/value block, and resending them pays only when
// the blocks the MoE layers free outweigh the rings' workspaces.
void switch_off_ampipe_cp_resend_kv(const ModelConfig& m, ParallelPlan& p, Warnings& warnings) {
  if (!p.ampipe_cp_resend_kv) return;
  if (p.ampipe_degree < 2 || p.context_parallel < 2) {
    p.ampipe_cp_resend_kv = false;
    warnings.push_back(
        "--ampipe-cp-resend-kv has no effect without --ampipe-degree 2 and "
        "--context-parallel-size > 1: only Ampipe's chunks under CP keep every key/value block");
    return;
  }
  if (p.pipeline_parallel != 1) return;
  // Each MoE layer frees cp - 1 blocks; the forward's and the backward's rings hold cp - 1 each.
  const int moe_layers = moe_layer_count(m);
  if (moe_layers <= 2)
    warnings.push_back(fmt::format(
        "--ampipe-cp-resend-kv saves no memory with {} MoE layer{} and no pipeline: each keeps "
        "cp - 1 key/value blocks fewer, and the two rings' workspaces hold 2 (cp - 1); it pays "
        "from 3 MoE layers a stage",
        moe_layers, moe_layers == 1 ? "" : "s"));
}

// It chains the experts' all-to-alls with their tensor-parallel gathers and scatters.
void switch_off_pipe_experts_multi_stream(ParallelPlan& p, Warnings& warnings) {
  if (!p.pipe_experts || !p.pipe_experts_multi_stream ||
      (p.sequence_parallel && p.expert_tensor_parallel > 1))
    return;
  p.pipe_experts_multi_stream = false;
  warnings.push_back(
      "--pipe-experts-multi-stream is switched off: it chains the items' all-to-alls with the "
      "split experts' tensor-parallel all-gathers and reduce-scatters, and needs "
      "--sequence-parallel with --moe-model-type deepspeed_moe (MindSpeed's rule); "
      "--pipe-experts-separate-streams gives dispatches and combines streams of their own");
}

void drop_pipe_experts_options_without_pipe_experts(ParallelPlan& p, Warnings& warnings) {
  if (p.pipe_experts || !(p.pipe_experts_multi_stream || p.pipe_experts_separate_streams ||
                          p.pipe_experts_multi_data > 1))
    return;
  warnings.push_back(
      "--pipe-experts-multi-stream, --pipe-experts-separate-streams and "
      "--pipe-experts-multi-data apply with --use-pipe-experts and are ignored without it");
  p.pipe_experts_multi_stream = p.pipe_experts_separate_streams = false;
  p.pipe_experts_multi_data = 1;
}

// Why --use-pipe-experts cannot apply to the plan (MindSpeed's rules, then weave's: at least two
// items to pipeline), or "" when it can. Expects experts, ep >= 1 and a degree >= 1.
std::string why_pipe_experts_cannot_apply(const ModelConfig& m, const ParallelPlan& p) {
  const int degree = p.ampipe_degree, slices = p.pipe_experts_multi_data;
  if (p.expert_parallel == 1)
    return "with --expert-model-parallel-size 1 there is no all-to-all to overlap";
  if (slices % degree != 0)
    return fmt::format(
        "--pipe-experts-multi-data ({}) must be divisible by --ampipe-degree ({}) (MindSpeed's "
        "rule)",
        slices, degree);
  if (degree > 1 && !(slices > degree || (slices == degree && p.pipe_experts_multi_stream)))
    return fmt::format(
        "with --ampipe-degree {} it needs --pipe-experts-multi-data > {} (or = {} with "
        "--pipe-experts-multi-stream), got {} (MindSpeed's rule)",
        degree, degree, degree, slices);
  // More slices than an expert's capacity: refused (check_pipe_experts) rather than switched off.
  if (m.moe_expert_capacity_factor > 0 && slices / degree > expert_capacity_per_chunk(m, p))
    return "";
  if (m.num_experts / p.expert_parallel == 1 && slices / degree == 1)
    return fmt::format(
        "one local expert ({} experts over {} expert-parallel ranks) and one capacity slice "
        "leave a single item: raise --pipe-experts-multi-data",
        m.num_experts, p.expert_parallel);
  return "";
}

void switch_off_pipe_experts(const ModelConfig& m, ParallelPlan& p, Warnings& warnings) {
  // Without experts, or with sizes below 1, a rule refuses the plan.
  if (!p.pipe_experts || m.num_experts < 1 || p.expert_parallel < 1 || p.ampipe_degree < 1) return;
  const std::string why = why_pipe_experts_cannot_apply(m, p);
  if (why.empty()) return;
  p.pipe_experts = p.pipe_experts_multi_stream = p.pipe_experts_separate_streams = false;
  p.pipe_experts_multi_data = 1;
  warnings.push_back("--use-pipe-experts is switched off: " + why);
}

}  // namespace

double expert_capacity_per_chunk(const ModelConfig& m, const ParallelPlan& p) {
  // Each slot routes S / (cp tp) x B / degree tokens; an expert takes ceil(f n k / E).
  const double routed = static_cast<double>(m.seq_length) /
                        (static_cast<double>(p.context_parallel) * p.tensor_parallel) *
                        p.micro_batch_size / p.ampipe_degree;
  return std::ceil(m.moe_expert_capacity_factor * routed * m.moe_router_topk / m.num_experts);
}

std::vector<std::string> derive_plan(const ModelConfig& m, ParallelPlan& p) {
  Warnings warnings;
  switch_off_sequence_parallel_without_tensor_parallel(p, warnings);
  split_experts_for_deepspeed_moe(p);
  derive_virtual_stages(m, p);
  drop_scheduler_without_pipeline(p, warnings);
  warn_ampipe_beyond_mindspeeds_rules(m, p, warnings);
  switch_off_ampipe_tp_sp_comm_overlap(p, warnings);
  switch_off_ampipe_cp_resend_kv(m, p, warnings);
  switch_off_pipe_experts_multi_stream(p, warnings);
  drop_pipe_experts_options_without_pipe_experts(p, warnings);
  switch_off_pipe_experts(m, p, warnings);
  return warnings;
}

}  // namespace weave::graphs
