// The parallel plan's flags: the parallel sizes, the pipeline's stages and schedule, and Ampipe
// with MindSpeed's pipelined experts.
#include "config/config_flag_groups.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"

namespace weave::graphs::flag_groups {

namespace {

using enum DescribedSection;
using P = ParallelPlan;
constexpr unsigned kPlanSize = kShowsDefault | kChoosesPlan;

constexpr ConfigFlag kParallelism[] = {
    {.name = "--devices",
     .group = FlagGroup::parallelism,
     .help = "Simulated devices (default: tp x cp x pp)",
     .check = at_least(1),
     .description = {.section = plan,
                     .key = "devices",
                     .value = [](const TrainerConfig& c) -> DescribedValue {
                       return std::int64_t{c.plan.devices()};
                     }},
     .properties = kChoosesPlan},
    {.name = "--tensor-model-parallel-size",
     .group = FlagGroup::parallelism,
     .help = "Tensor-parallel ranks: each layer's matrices split over them",
     .field = plan_field<&P::tensor_parallel>(),
     .check = at_least(1),
     .description = described(plan, "tensor_model_parallel_size", true),
     .properties = kPlanSize},
    {.name = "--sequence-parallel",
     .group = FlagGroup::parallelism,
     .values = 0,
     .help = "With tensor parallelism: the norms and dropout split over the sequence too",
     .field = plan_field<&P::sequence_parallel>(),
     .description = described(plan, "sequence_parallel", true),
     .properties = kChoosesPlan},
    {.name = "--context-parallel-size",
     .group = FlagGroup::parallelism,
     .help = "Context-parallel ranks: each sample's sequence split over them (ring attention)",
     .field = plan_field<&P::context_parallel>(),
     .check = at_least(1),
     .description = described(plan, "context_parallel_size", true),
     .properties = kPlanSize},
    {.name = "--expert-model-parallel-size",
     .group = FlagGroup::parallelism,
     .help = "Expert-parallel ranks: the experts divided among them",
     .field = plan_field<&P::expert_parallel>(),
     .check = at_least(1),
     .description = described(plan, "expert_model_parallel_size", true),
     .properties = kPlanSize},
    {.name = "--expert-tensor-parallel-size",
     .group = FlagGroup::parallelism,
     .help = "1: every expert whole on one rank; the tensor-parallel size: every expert split "
             "over the tensor-parallel group (fc1 by columns, fc2 by rows)",
     .field = plan_field<&P::expert_tensor_parallel>(),
     .check = at_least(1),
     .description = described(plan, "expert_tensor_parallel_size", true),
     .properties = kPlanSize},
    {.name = "--moe-model-type",
     .group = FlagGroup::parallelism,
     .help = "megatron_moe (MindSpeed's default; weave also reads megatron: Megatron-Core's "
             "router, experts whole) or deepspeed_moe (MindSpeed's: its gate, and experts split "
             "over the tensor-parallel group with expert-parallel groups of one tp rank; without "
             "--sequence-parallel every tp rank gates the whole sequence, dispatches the same "
             "tokens and all-reduces its experts' partial sums over tp, as MindSpeed does)",
     .field = plan_field<&P::moe_model_type>(),
     .description = described(plan, "moe_model_type")},
    {.name = "--use-distributed-optimizer",
     .group = FlagGroup::parallelism,
     .values = 0,
     .help = "Shard optimizer state over data-parallel replicas (reduce-scatter + all-gather)",
     .field = plan_field<&P::distributed_optimizer>(),
     .description = described(plan, "use_distributed_optimizer", true)},
    {.name = "--zero-stage",
     .group = FlagGroup::parallelism,
     .help = "DeepSpeed's ZeRO stage: 0 plain data parallelism; 1 optimizer state sharded over "
             "the data-parallel group (weave's distributed optimizer); 2 gradients sharded too "
             "(each micro-batch's layer buckets reduce-scattered into the replica's shard); 3 "
             "parameters too (each layer's gathered before its forward and its backward)",
     .check = at_least(0),
     .properties = kChoosesPlan,
     .type_name = "N"},
    {.name = "--zero-units-in-flight",
     .group = FlagGroup::parallelism,
     .help = "ZeRO stage 3: the layers whose gathered parameters a device holds at once, the one "
             "computing and the next N - 1, whose gathers run under its compute (default 2; 1 "
             "gathers each layer once the previous one is done). DeepSpeed bounds the same by "
             "stage3_max_live_parameters, in elements",
     .field = plan_field<&P::zero_units_in_flight>(),
     .check = at_least(1),
     .properties = kPlanSize,
     .type_name = "N"},
    {.name = "--use-custom-fsdp",
     .aliases = "--use-megatron-fsdp",
     .group = FlagGroup::parallelism,
     .values = 0,
     .help = "Megatron-Core's fully sharded data parallelism, by "
             "--data-parallel-sharding-strategy (default no_shard, as in Megatron-Core 0.12 to "
             "0.15)"},
    {.name = "--data-parallel-sharding-strategy",
     .group = FlagGroup::parallelism,
     .help = "With --use-custom-fsdp: no_shard (plain data parallelism), optim (optimizer state "
             "sharded: weave's distributed optimizer), optim_grads (gradients too: ZeRO stage 2) "
             "or optim_grads_params (parameters too: stage 3)",
     .check = one_of("no_shard,optim,optim_grads,optim_grads_params"),
     .properties = kChoosesPlan},
    {.name = "--overlap-grad-reduce",
     .group = FlagGroup::parallelism,
     .values = 0,
     .help = "Reduce each bucket's data-parallel gradients as soon as the backward has produced "
             "them, overlapping the rest of the backward (under the 1F1B schedule without "
             "virtual stages on the first pipeline stage only: the later ones reduce after their "
             "last backward, as Megatron-LM's default --delay-grad-reduce has them); without it "
             "they are reduced after the step's last backward task, as Megatron-LM does by "
             "default (refused with Ampipe, as MindSpeed does)",
     .field = plan_field<&P::overlap_grad_reduce>(),
     .description = described(plan, "overlap_grad_reduce"),
     .properties = kRefusedBesideAmpipe},
    {.name = "--overlap-param-gather",
     .group = FlagGroup::parallelism,
     .values = 0,
     .help = "With --use-distributed-optimizer and --overlap-grad-reduce (Megatron-LM requires "
             "both): the updated shards are gathered at the start of the next step instead of "
             "after the update, each layer's forward waiting only for its own bucket's gather, "
             "as Megatron-LM's forward pre-hooks do; the parameters are gathered before a save, "
             "an evaluation and the run's end (refused with Ampipe, as MindSpeed does)",
     .field = plan_field<&P::overlap_param_gather>(),
     .description = described(plan, "overlap_param_gather"),
     .properties = kRefusedBesideAmpipe},
    {.name = "--tp-comm-overlap",
     .group = FlagGroup::parallelism,
     .values = 0,
     .help = "With --sequence-parallel (Megatron-LM asserts it): the sequence-parallel "
             "all-gathers before the QKV and fc1 products (forward) and before the projection's "
             "and fc2's input gradients (backward) in tp pieces, the reduce-scatters after the "
             "projection and fc2 (forward) in 4, each piece pipelined with the product's rows it "
             "brings or takes, the rank's own rows first, as Transformer Engine's default "
             "userbuffer overlaps (ring exchange, pipeline) do for Megatron-Core; the weight "
             "gradients stay whole; local attention only "
             "(context parallelism's ring keeps whole collectives); refused with Ampipe",
     .field = plan_field<&P::tp_comm_overlap>(),
     .description = described(plan, "tp_comm_overlap")},
    {.name = "--micro-batch-size",
     .group = FlagGroup::parallelism,
     .help = "Samples per micro-batch",
     .field = plan_field<&P::micro_batch_size>(),
     .check = at_least(1),
     .description = described(plan, "micro_batch_size"),
     .properties = kShowsDefault},
    {.name = "--global-batch-size",
     .group = FlagGroup::parallelism,
     .help = "Default: micro-batch x data-parallel size",
     .field = plan_field<&P::global_batch_size>(),
     .check = at_least(1),
     .description = described(plan, "global_batch_size"),
     .properties = kChoosesPlan},
};

constexpr ConfigFlag kPipeline[] = {
    {.name = "--pipeline-model-parallel-size",
     .group = FlagGroup::pipeline,
     .help = "Pipeline stages: the layers divided among them",
     .field = plan_field<&P::pipeline_parallel>(),
     .check = at_least(1),
     .description = described(plan, "pipeline_model_parallel_size", true),
     .properties = kPlanSize},
    {.name = "--pipeline-scheduler",
     .group = FlagGroup::pipeline,
     .help = "gpipe, 1f1b, interleaved, interleaved-mem, zb-h1 or zb-v (default: 1f1b, "
             "interleaved with virtual stages); `weave schedule` draws them",
     .field = plan_field<&P::pipeline_scheduler>(),
     .description = {.section = plan,
                     .key = "pipeline_scheduler",
                     .value = [](const TrainerConfig& c) -> DescribedValue {
                       return c.plan.pipeline_parallel > 1
                                  ? std::string(schedule_name(pipeline_schedule_kind(c.plan)))
                                  : std::string();
                     }},
     .properties = kChoosesPlan},
    {.name = "--num-layers-per-virtual-pipeline-stage",
     .group = FlagGroup::pipeline,
     .help = "Layers per model chunk: chunks per pipeline rank = layers / (pp x this)",
     .field = plan_field<&P::layers_per_virtual_stage>(),
     .check = at_least(1),
     .properties = kChoosesPlan},
    {.name = "--virtual-pipeline-model-parallel-size",
     .group = FlagGroup::pipeline,
     .help = "Model chunks per pipeline rank (instead of --num-layers-per-virtual-pipeline-stage)",
     .field = plan_field<&P::virtual_pipeline>(),
     .check = at_least(1),
     .description =
         added_to_checkpoints(described(plan, "virtual_pipeline_model_parallel_size", true)),
     .properties = kChoosesPlan},
    {.name = "--microbatch-group-size-per-virtual-pipeline-stage",
     .group = FlagGroup::pipeline,
     .help = "Interleaved schedule: micro-batches run on one chunk before the next (default: pp)",
     .field = plan_field<&P::microbatch_group_size>(),
     .check = at_least(1),
     .description = described(plan, "microbatch_group_size_per_virtual_pipeline_stage"),
     .properties = kChoosesPlan},
    {.name = "--decoder-first-pipeline-num-layers",
     .group = FlagGroup::pipeline,
     .help = "Layers of the first model chunk (the rest split evenly)",
     .field = plan_field<&P::first_stage_layers>(),
     .check = at_least(1),
     .description =
         added_to_checkpoints(described(plan, "decoder_first_pipeline_num_layers", true)),
     .properties = kChoosesPlan},
    {.name = "--decoder-last-pipeline-num-layers",
     .group = FlagGroup::pipeline,
     .help = "Layers of the last model chunk (the rest split evenly)",
     .field = plan_field<&P::last_stage_layers>(),
     .check = at_least(1),
     .description = added_to_checkpoints(described(plan, "decoder_last_pipeline_num_layers", true)),
     .properties = kChoosesPlan},
};

constexpr ConfigFlag kAmpipe[] = {
    {.name = "--ampipe-degree",
     .group = FlagGroup::ampipe,
     .help = "Sequence chunks pipelining attention with the MoE all-to-alls (Ampipe); what "
             "MindSpeed refuses beside it (EP 1, experts other than deepspeed_moe, biased linear "
             "layers) runs with a warning that names it. With tensor parallelism and no "
             "--sequence-parallel each chunk's projection is all-reduced; MindSpeed's gate "
             "(--moe-model-type deepspeed_moe) routes the whole chunk on every tp rank, as "
             "MindSpeed does, Megatron-Core's router each tp rank's own slice of it (--seq-length "
             "divisible by degree x tp)",
     .field = plan_field<&P::ampipe_degree>(),
     .check = at_least(1),
     .description = described(plan, "ampipe_degree"),
     .properties = kPlanSize},
    {.name = "--ampipe-tp-sp-comm-overlap",
     .group = FlagGroup::ampipe,
     .values = 0,
     .help =
         "Pipeline the split experts' tensor-parallel collectives over (chunk, local expert) "
         "items, each item's fc2 partial sums reduced over tp while the next item's fc1 "
         "computes, as MindSpeed overlaps each item's reduce-scatter (with --sequence-parallel) "
         "or all-reduce (without) with the next item's fc1; the next item's rows are "
         "all-gathered under this item's fc1. Without SP MindSpeed's gate routes the whole "
         "chunk on every tp rank, so each item's rows are there already and its fc2 partial sums "
         "are all-reduced under the next item's fc1, its combine issued after that fc1, as "
         "MindSpeed does; Megatron-Core's router there routes each tp rank's slice of the "
         "chunk, so its items are gathered and reduce-scattered and the chunk's output gathered "
         "after the combine (needs --ampipe-degree > 1, EP > 1 and split experts: "
         "--moe-model-type deepspeed_moe, or --expert-tensor-parallel-size = "
         "--tensor-model-parallel-size with Megatron-Core's router)",
     .field = plan_field<&P::ampipe_tp_sp_comm_overlap>(),
     .description = described(plan, "ampipe_tp_sp_comm_overlap")},
    {.name = "--ampipe-cp-resend-kv",
     .group = FlagGroup::ampipe,
     .values = 0,
     .help = "Under CP: send the key/value blocks round the ring again in backward instead of "
             "keeping them all from forward (less activation memory, cp - 1 more ring steps per "
             "layer under the MoE backward)",
     .field = plan_field<&P::ampipe_cp_resend_kv>(),
     .description = described(plan, "ampipe_cp_resend_kv")},
    {.name = "--use-pipe-experts",
     .group = FlagGroup::ampipe,
     .values = 0,
     .help = "Run each MoE slot as items (local expert x capacity slice), each with its own "
             "dispatch and combine all-to-all",
     .field = plan_field<&P::pipe_experts>(),
     .description = described(plan, "use_pipe_experts")},
    {.name = "--pipe-experts-multi-stream",
     .group = FlagGroup::ampipe,
     .values = 0,
     .help = "With --use-pipe-experts: the items' all-to-alls and tensor-parallel all-gathers "
             "and reduce-scatters in one strict order, so expert- and tensor-parallel traffic "
             "never share the links; needs --sequence-parallel and --moe-model-type "
             "deepspeed_moe (under Ampipe the dispatches stay out of the order, each waiting "
             "for its chunk's router only, as MindSpeed's Ampipe issues them)",
     .field = plan_field<&P::pipe_experts_multi_stream>(),
     .description = described(plan, "pipe_experts_multi_stream")},
    {.name = "--pipe-experts-separate-streams",
     .group = FlagGroup::ampipe,
     .values = 0,
     .help = "With --use-pipe-experts: the items' dispatches and combines on streams of their "
             "own (weave's)",
     .field = plan_field<&P::pipe_experts_separate_streams>(),
     .description = described(plan, "pipe_experts_separate_streams")},
    {.name = "--pipe-experts-multi-data",
     .group = FlagGroup::ampipe,
     .help = "With --use-pipe-experts: capacity slices per expert (divided among Ampipe chunks; "
             "under Ampipe, split experts run every chunk's items in one pipeline, "
             "expert-major: each local expert's slices of every chunk before the next "
             "expert's, as MindSpeed's PipeExpert runs them; whole experts run each chunk's "
             "items in turn, with a warning: MindSpeed's PipeExpert fails on them without "
             "--ampipe-tp-sp-comm-overlap)",
     .field = plan_field<&P::pipe_experts_multi_data>(),
     .check = at_least(1),
     .description = described(plan, "pipe_experts_multi_data"),
     .properties = kShowsDefault},
};

}  // namespace

std::span<const ConfigFlag> parallelism_flags() {
  return kParallelism;
}

std::span<const ConfigFlag> pipeline_flags() {
  return kPipeline;
}

std::span<const ConfigFlag> ampipe_flags() {
  return kAmpipe;
}

}  // namespace weave::graphs::flag_groups
