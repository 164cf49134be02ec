// The run's flags: the optimizer and its learning rate, how long to train and evaluate, the data,
// checkpoints, what the run writes, the machine the virtual clock models, and the advice that
// replaces a run.
#include <string>

#include "config/config_flag_groups.hpp"

namespace weave::graphs::flag_groups {

namespace {

using enum DescribedSection;
using LR = LearningRateSchedule;
using T = TrainerConfig;

template <auto Member>
constexpr ConfigField adamw() {
  return config_field<&T::optimizer, &OptimizerConfig::adamw, Member>();
}

constexpr ConfigFlag kOptimizer[] = {
    {.name = "--lr",
     .group = FlagGroup::learning_rate,
     .help = "Peak learning rate. Given, the schedule flags left out take Megatron-LM's "
             "defaults (--min-lr 0, --lr-warmup-iters 0, --lr-decay-style linear); not given, "
             "weave's (3e-3 to 3e-4 by cosine after 10 warm-up iterations)",
     .field = learning_rate_field<&LR::lr>(),
     .check = kNonNegative,
     .description = described(DescribedSection::learning_rate, "lr"),
     .properties = kShowsDefault},
    {.name = "--min-lr",
     .group = FlagGroup::learning_rate,
     .help = "Learning rate at the end of the decay, at most --lr",
     .field = learning_rate_field<&LR::min_lr>(),
     .check = kNonNegative,
     .description = described(DescribedSection::learning_rate, "min_lr"),
     .properties = kShowsDefault},
    {.name = "--lr-warmup-iters",
     .group = FlagGroup::learning_rate,
     .help = "Iterations of linear warm-up from 0 to --lr",
     .field = learning_rate_field<&LR::warmup_iters>(),
     .check = at_least(0),
     .description = described(DescribedSection::learning_rate, "lr_warmup_iters"),
     .properties = kShowsDefault},
    {.name = "--lr-decay-iters",
     .group = FlagGroup::learning_rate,
     .help = "Default: --train-iters",
     .field = learning_rate_field<&LR::decay_iters>(),
     .check = at_least(0),
     .description = described(DescribedSection::learning_rate, "lr_decay_iters")},
    {.name = "--lr-warmup-samples",
     .group = FlagGroup::learning_rate,
     .help = "With --train-samples: samples of linear warm-up from 0 to --lr (Megatron-LM's "
             "scheduler counts samples)",
     .field = learning_rate_field<&LR::warmup_samples>(),
     .check = at_least(0),
     .description = described(DescribedSection::learning_rate, "lr_warmup_samples")},
    {.name = "--lr-decay-samples",
     .group = FlagGroup::learning_rate,
     .help = "With --train-samples: the samples over which the rate decays; default: "
             "--train-samples",
     .field = learning_rate_field<&LR::decay_samples>(),
     .check = at_least(0),
     .description = described(DescribedSection::learning_rate, "lr_decay_samples")},
    {.name = "--lr-decay-style",
     .group = FlagGroup::learning_rate,
     .help = "Decay from --lr to --min-lr after the warm-up",
     .field = learning_rate_field<&LR::style>(),
     .check = one_of("cosine,linear,constant"),
     .description = described(DescribedSection::learning_rate, "lr_decay_style"),
     .properties = kShowsDefault},
    {.name = "--weight-decay",
     .group = FlagGroup::optimizer,
     .help = "AdamW's decoupled weight decay",
     .field = adamw<&ops::AdamWOptions::weight_decay>(),
     .check = kNonNegative,
     .description = described(optimizer, "weight_decay"),
     .properties = kShowsDefault},
    {.name = "--optimizer",
     .group = FlagGroup::optimizer,
     .help = "adam: weave's optimizer is AdamW (Megatron's adam, decoupled weight decay)",
     .check = one_of("adam"),
     .properties = kShowsDefault},
    {.name = "--adam-beta1",
     .group = FlagGroup::optimizer,
     .help = "AdamW's first-moment decay, in [0, 1)",
     .field = adamw<&ops::AdamWOptions::beta1>(),
     .description = described(optimizer, "adam_beta1"),
     .properties = kShowsDefault},
    {.name = "--adam-beta2",
     .group = FlagGroup::optimizer,
     .help = "AdamW's second-moment decay, in [0, 1)",
     .field = adamw<&ops::AdamWOptions::beta2>(),
     .description = described(optimizer, "adam_beta2"),
     .properties = kShowsDefault},
    {.name = "--adam-eps",
     .group = FlagGroup::optimizer,
     .help = "AdamW's epsilon, > 0",
     .field = adamw<&ops::AdamWOptions::eps>(),
     .description = described(optimizer, "adam_eps"),
     .properties = kShowsDefault},
    {.name = "--clip-grad",
     .group = FlagGroup::optimizer,
     .help = "0: no clipping",
     .field = config_field<&T::optimizer, &OptimizerConfig::clip_grad>(),
     .check = kNonNegative,
     .description = described(optimizer, "clip_grad"),
     .properties = kShowsDefault},
    {.name = "--loss-scale",
     .group = FlagGroup::optimizer,
     .help = "A constant loss scale for --fp16 or --bf16 (Megatron-LM's ConstantGradScaler); "
             "without it an fp16 run scales dynamically and a bf16 run not at all",
     .field = config_field<&T::loss_scale, &LossScaleConfig::loss_scale>(),
     .check = kNonNegative},
    {.name = "--initial-loss-scale",
     .group = FlagGroup::optimizer,
     .help = "The dynamic loss scale's start (--fp16 without --loss-scale)",
     .field = config_field<&T::loss_scale, &LossScaleConfig::initial_loss_scale>(),
     .check = kPositive,
     .properties = kShowsDefault},
    {.name = "--min-loss-scale",
     .group = FlagGroup::optimizer,
     .help = "The dynamic loss scale never halves below this",
     .field = config_field<&T::loss_scale, &LossScaleConfig::min_loss_scale>(),
     .check = kPositive,
     .properties = kShowsDefault},
    {.name = "--loss-scale-window",
     .group = FlagGroup::optimizer,
     .help = "Steps without an overflow after which the dynamic loss scale doubles",
     .field = config_field<&T::loss_scale, &LossScaleConfig::loss_scale_window>(),
     .check = at_least(1),
     .properties = kShowsDefault},
    {.name = "--hysteresis",
     .group = FlagGroup::optimizer,
     .help = "Steps with an overflow (counted since the scale last grew) after which the dynamic "
             "loss scale halves, and every overflow after them halves it again",
     .field = config_field<&T::loss_scale, &LossScaleConfig::hysteresis>(),
     .check = at_least(1),
     .properties = kShowsDefault},
};

constexpr ConfigFlag kConfigFile[] = {
    {.name = "--config",
     .group = FlagGroup::config_file,
     .help = "JSON file of flag names and values (flags given here win)",
     .properties = kNotRepeatedByAdvice},
    {.name = "--deepspeed",
     .group = FlagGroup::config_file,
     .values = 0,
     .help = "Megatron-DeepSpeed's switch to train under DeepSpeed's engine; weave is its own "
             "engine, so here it means: read --deepspeed_config and map it onto weave's flags"},
    {.name = "--deepspeed_config",
     .aliases = "--deepspeed-config",
     .group = FlagGroup::config_file,
     .help = "DeepSpeed's JSON (with --deepspeed): batch sizes, gradient_clipping, "
             "zero_optimization.stage, an Adam/AdamW optimizer's values onto weave's flags, "
             "checked against those given; half precision and fields that change training "
             "refused; the rest named once as without effect",
     .properties = kNotRepeatedByAdvice,
     .type_name = "FILE"},
};

constexpr ConfigFlag kTraining[] = {
    {.name = "--recompute-granularity",
     .group = FlagGroup::training,
     .help = "full: recomputed layers keep only their input and run their forward again right "
             "before their backward (with --recompute-method and --recompute-num-layers); "
             "selective: the modules --recompute-modules names are recomputed",
     .check = one_of("full,selective"),
     .properties = kChoosesPlan},
    {.name = "--recompute-activations",
     .group = FlagGroup::training,
     .values = 0,
     .help = "Megatron-LM's shorthand for --recompute-granularity selective",
     .properties = kChoosesPlan},
    {.name = "--recompute-modules",
     .group = FlagGroup::training,
     .help = "With --recompute-granularity selective, Megatron-Core's modules: core_attn (the "
             "default; weave's blockwise attention recomputes its scores in every backward "
             "anyway), mlp (each dense MLP keeps its input and runs its forward again before its "
             "backward), layernorm (the input and pre-MLP norms' outputs are recomputed before "
             "their modules' backward), moe_act (the MoE experts' activation is recomputed for "
             "fc2's weight gradient), moe (each MoE layer keeps its input and runs its forward "
             "again before its backward)",
     .check = one_of("core_attn,mlp,moe,moe_act,layernorm"),
     .properties = kChoosesPlan,
     .type_name = "MODULE ..."},
    {.name = "--recompute-method",
     .group = FlagGroup::training,
     .help = "With --recompute-granularity full: uniform recomputes each model chunk's layers in "
             "groups of --recompute-num-layers, each keeping its input; block recomputes the "
             "first --recompute-num-layers layers of each chunk",
     .check = one_of("uniform,block"),
     .properties = kChoosesPlan},
    {.name = "--recompute-num-layers",
     .group = FlagGroup::training,
     .help = "With --recompute-granularity full: layers per group (uniform) or layers recomputed "
             "per model chunk (block), 1 to the layers of a pipeline rank",
     .field =
         config_field<&TrainerConfig::model, &ModelConfig::recompute, &Recompute::num_layers>(),
     .properties = kChoosesPlan},
    {.name = "--train-iters",
     .group = FlagGroup::training,
     .help = "Iterations to train",
     .field = run_field<&T::train_iters>(),
     .check = at_least(1),
     .description = described(DescribedSection::run, "train_iters"),
     .properties = kShowsDefault},
    {.name = "--train-samples",
     .group = FlagGroup::training,
     .help = "Samples to train, in place of --train-iters: the iterations follow from the batch "
             "(and its ramp-up) as in Megatron-LM, and the learning rate counts samples "
             "(--lr-warmup-samples, --lr-decay-samples)",
     .field = run_field<&T::train_samples>(),
     .check = at_least(1),
     .description = described(DescribedSection::run, "train_samples")},
    {.name = "--rampup-batch-size",
     .group = FlagGroup::training,
     .values = 3,
     .help = "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT to "
             "--global-batch-size over SAMPLES samples, as Megatron-LM ramps it (with "
             "--train-samples); each batch's step is built once",
     .description = {.section = DescribedSection::run,
                     .key = "rampup_batch_size",
                     .value = [](const TrainerConfig& c) -> DescribedValue {
                       const BatchRampup& r = c.rampup;
                       if (!r.enabled()) return std::string();
                       return std::to_string(r.start) + " " + std::to_string(r.increment) + " " +
                              std::to_string(r.samples);
                     }},
     .type_name = "START INCREMENT SAMPLES"},
    {.name = "--eval-interval",
     .group = FlagGroup::training,
     .help = "Evaluate on the held-out text every this many iterations",
     .field = run_field<&T::eval_interval>(),
     .check = at_least(0),
     .description = described(DescribedSection::run, "eval_interval")},
    {.name = "--eval-iters",
     .group = FlagGroup::training,
     .help = "Global batches each evaluation averages",
     .field = run_field<&T::eval_iters>(),
     .check = at_least(1),
     .description = described(DescribedSection::run, "eval_iters"),
     .properties = kShowsDefault},
    {.name = "--data-path",
     .group = FlagGroup::data,
     .help = "An indexed dataset's prefix (PREFIX.bin and PREFIX.idx, from weave preprocess or "
             "Megatron's preprocess_data.py), a blend of them as weight and prefix pairs (0.3 A "
             "0.7 B), or a text file or a folder of them (byte tokens)",
     .properties = kShowsDefault},
    {.name = "--split",
     .group = FlagGroup::data,
     .help = "Weights of the train, validation and test parts, like 949,50,1: an indexed "
             "dataset's documents split as Megatron splits them (default 969,30,1); a text's "
             "validation share held out (default: 5 %); there is no test evaluation"},
    {.name = "--data-cache-path",
     .group = FlagGroup::data,
     .help = "Folder for an indexed dataset's sample indices (default: PREFIX/cache/"
             "GPTDataset_indices, beside the data); they are built once and rebuilt when the "
             "data or a setting changes"},
    {.name = "--tokenizer-type",
     .group = FlagGroup::data,
     .help = "The tokenizer an indexed dataset was made with, which gives the vocabulary: "
             "GPT2BPETokenizer (with --vocab-file and --merge-file) or ByteTokenizer (bytes and "
             "an end of document, 257 ids); text files are always bytes (256)",
     .field = config_field<&T::model, &ModelConfig::tokenizer_type>(),
     .description =
         added_to_checkpoints(described(DescribedSection::model, "tokenizer_type", true)),
     .properties = kShowsDefault},
    {.name = "--vocab-file",
     .group = FlagGroup::data,
     .help = "GPT2BPETokenizer's vocabulary, GPT-2's vocab.json",
     .field = config_field<&T::model, &ModelConfig::vocab_file>(),
     .description = added_to_checkpoints(described(DescribedSection::model, "vocab_file", true))},
    {.name = "--merge-file",
     .group = FlagGroup::data,
     .help = "GPT2BPETokenizer's merges, GPT-2's merges.txt",
     .field = config_field<&T::model, &ModelConfig::merge_file>(),
     .description = added_to_checkpoints(described(DescribedSection::model, "merge_file", true))},
    {.name = "--mock-data",
     .group = FlagGroup::data,
     .values = 0,
     .help = "Synthetic tokens instead of --data-path"},
    {.name = "--save",
     .group = FlagGroup::checkpoint,
     .help = "Checkpoint file to write",
     .field = run_field<&T::save_path>(),
     .description = described(DescribedSection::run, "save")},
    {.name = "--load",
     .group = FlagGroup::checkpoint,
     .help = "Checkpoint file to resume from",
     .field = run_field<&T::load_path>(),
     .description = described(DescribedSection::run, "load")},
    {.name = "--save-interval",
     .group = FlagGroup::checkpoint,
     .help = "With --save: also save every this many iterations",
     .field = run_field<&T::save_interval>(),
     .check = at_least(0),
     .description = described(DescribedSection::run, "save_interval")},
};

constexpr ConfigFlag kOutput[] = {
    {.name = "--log-interval",
     .group = FlagGroup::logging,
     .help = "A progress line (and the communication measured) every this many iterations",
     .field = run_field<&T::metrics_interval>(),
     .check = at_least(1),
     .description = described(DescribedSection::run, "log_interval"),
     .properties = kShowsDefault},
    {.name = "--log-json",
     .group = FlagGroup::logging,
     .help = "Write metrics as JSON lines to this file"},
    {.name = "--trace",
     .group = FlagGroup::logging,
     .help = "Write the Chrome trace of one iteration here",
     .field = run_field<&T::trace_path>(),
     .description = described(DescribedSection::run, "trace"),
     .properties = kNotRepeatedByAdvice},
    {.name = "--trace-iteration",
     .group = FlagGroup::logging,
     .help = "Which iteration --trace records (default: 2, or the last of a shorter run)",
     .field = run_field<&T::trace_iteration>(),
     .check = at_least(1),
     .description = described(DescribedSection::run, "trace_iteration"),
     .properties = kShowsDefault},
    {.name = "--dump-graph",
     .group = FlagGroup::logging,
     .help = "Write the step's task graph as GraphViz DOT here (--graph-filter and "
             "--graph-level choose what it draws)"},
    {.name = "--graph-filter",
     .group = FlagGroup::logging,
     .help = "With --dump-graph: draw only these tasks, e.g. device=0,layer=3,phase=F (keys "
             "device, stream, layer, micro-batch, chunk, phase F/B/W; a key may repeat)"},
    {.name = "--graph-level",
     .group = FlagGroup::logging,
     .help = "With --dump-graph or --report: a node per task, layer (device, stream, layer, "
             "phase), stage-micro-batch (device, stream, micro-batch, phase) or step (device and "
             "stream); auto: the finest level that draws at most 400 nodes (--report: layer)",
     .properties = kShowsDefault},
    {.name = "--critical-path",
     .group = FlagGroup::logging,
     .values = 0,
     .help = "Replay the step on the virtual clock of --link, --device-flops or --accelerator "
             "and print the chain of tasks that sets its time, by kind and by what each waited "
             "for (drawn heavy in --dump-graph); weave train prints it on the wall clock too, "
             "after training, read from the spans iteration --trace-iteration recorded",
     .properties = kNotRepeatedByAdvice},
    {.name = "--what-if",
     .group = FlagGroup::logging,
     .help = "With --critical-path: replay the same step with costs changed and print the new "
             "step time and what moved: ep=free, tp*2, compute*0.5, attention*0.5 (a stream's "
             "transfers free or moving f times the bytes; compute or its attention part f times "
             "the work), joined by commas",
     .properties = kNotRepeatedByAdvice},
    {.name = "--report",
     .group = FlagGroup::logging,
     .help = "Replay the step on the virtual clock and write it as one self-contained HTML page "
             "here: every device's and stream's timeline, the graph by layer (click a node for "
             "its tasks), the critical path (weave train's on the wall clock too), exposed "
             "communication per group, memory per device over the step and the configuration; a "
             "step of more than 100,000 tasks is refused once built, before its replay or "
             "training",
     .properties = kNotRepeatedByAdvice},
    {.name = "--figure",
     .group = FlagGroup::logging,
     .help = "Replay the step on the virtual clock and draw it as SVG into --figure-out: ampipe "
             "(one layer's Ampipe pipeline on one device: --layer, --figure-device) or pipeline "
             "(every stage's micro-batches by phase)",
     .check = one_of("ampipe,pipeline"),
     .properties = kNotRepeatedByAdvice},
    {.name = "--figure-out",
     .group = FlagGroup::logging,
     .help = "With --figure: the SVG file to write (default: ampipe.svg or pipeline.svg)",
     .properties = kNotRepeatedByAdvice},
    {.name = "--layer",
     .group = FlagGroup::logging,
     .help = "With --figure ampipe: the layer to draw (0 .. --num-layers - 1)",
     .check = at_least(0),
     .properties = kNotRepeatedByAdvice},
    {.name = "--figure-device",
     .group = FlagGroup::logging,
     .help = "With --figure ampipe: the device whose streams are drawn (default: the first "
             "device of the pipeline stage holding --layer)",
     .check = at_least(0),
     .properties = kNotRepeatedByAdvice},
    {.name = "--ampipe-advise",
     .group = FlagGroup::advice,
     .values = 0,
     .help = "Instead of training: predict one step at each Ampipe degree as "
             "weave predict does (built without tensors, data-parallel replicas "
             "folded, on the virtual clock of --link, --device-flops or "
             "--accelerator) and name the fastest that fits a device's memory "
             "(the --accelerator's, else 80 GiB; weave predict takes "
             "--device-memory); also accepted by weave predict",
     .properties = kNotRepeatedByAdvice},
    {.name = "--pipeline-advise",
     .group = FlagGroup::advice,
     .values = 0,
     .help = "Instead of training: predict one step under every pipeline "
             "schedule as weave predict does (--link, --device-flops or "
             "--accelerator): step time, bubble predicted and in theory, memory "
             "per device and activation memory per stage; the fastest that fits "
             "a device's memory named; also accepted by weave predict",
     .properties = kNotRepeatedByAdvice},
};

constexpr ConfigFlag kMachine[] = {
    {.name = "--timing",
     .group = FlagGroup::machine,
     .help = "wall: real threads; model: the virtual clock",
     .check = one_of("wall,model"),
     .description = {.section = DescribedSection::run,
                     .key = "timing",
                     .value = [](const TrainerConfig& c) -> DescribedValue {
                       return std::string(c.timing == Timing::virtual_clock ? "model" : "wall");
                     }},
     .properties = kShowsDefault},
    {.name = "--link",
     .group = FlagGroup::machine,
     .help = "Link model: a preset (see `weave topo --links`) or GBPS:MICROSECONDS",
     .field = machine_field<&ModelledMachine::link>(),
     .description = described(DescribedSection::run, "link"),
     .properties = kShowsDefault},
    {.name = "--accelerator",
     .group = FlagGroup::machine,
     .help = "Model the devices as this accelerator (--timing model, weave predict): a preset "
             "(a100-80gb, h100-sxm, ascend-910b) or a JSON file (weave calibrate writes this "
             "host's); prices matrix products by their shapes, attention and streaming at the "
             "rates it states (--device-flops and --device-memory-bandwidth given are "
             "overridden), --link to its node's link unless --link is given, and the cluster "
             "collectives are costed on: its node and network (--devices-per-node, --node-link, "
             "--network override them)"},
    {.name = "--devices-per-node",
     .group = FlagGroup::machine,
     .help = "Devices in a node of the modelled cluster (--timing model, weave "
             "predict): rank r sits on node r / N, and collectives are costed "
             "by the algorithm their group would use on the links it spans "
             "(ring or tree in a node, hierarchical across nodes, all-to-all "
             "messages in flight together); default the --accelerator's. "
             "Without --accelerator, give --node-link and --network too",
     .check = at_least(1),
     .type_name = "N"},
    {.name = "--node-link",
     .group = FlagGroup::machine,
     .help = "The modelled cluster's link between the devices of a node, GBPS:MICROSECONDS per "
             "device (default: the --accelerator's)",
     .type_name = "GBPS:US"},
    {.name = "--network",
     .group = FlagGroup::machine,
     .help = "The modelled cluster's network between nodes, GBPS:MICROSECONDS of each device's "
             "NIC (default: the --accelerator's)",
     .type_name = "GBPS:US"},
    {.name = "--device-memory-bandwidth",
     .group = FlagGroup::machine,
     .help = "Modelled bytes/s a device streams (--timing model): prices norms, residuals, "
             "dropout and the optimizer",
     .field = machine_field<&ModelledMachine::device_memory_bandwidth>(),
     .check = kPositive,
     .properties = kShowsDefault},
    {.name = "--device-flops",
     .group = FlagGroup::machine,
     .help = "Modelled FLOP/s of a device (--timing model)",
     .field = machine_field<&ModelledMachine::device_flops>(),
     .check = kPositive,
     .description = described(DescribedSection::run, "device_flops"),
     .properties = kShowsDefault},
};

}  // namespace

std::span<const ConfigFlag> config_file_flags() {
  return kConfigFile;
}

std::span<const ConfigFlag> optimizer_flags() {
  return kOptimizer;
}

std::span<const ConfigFlag> training_flags() {
  return kTraining;
}

std::span<const ConfigFlag> output_flags() {
  return kOutput;
}

std::span<const ConfigFlag> machine_flags() {
  return kMachine;
}

}  // namespace weave::graphs::flag_groups
