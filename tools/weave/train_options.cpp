#include "train_options.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "commands.hpp"
#include "megatron_flags.hpp"
#include "weave/devices/accelerator.hpp"
#include "weave/graphs/parallel_plan.hpp"

namespace weave::cli {

namespace {

// The validation share of Megatron's --split weights "train,valid,test" (missing ones are 0).
double validation_share(const std::string& split) {
  std::vector<double> weights;
  std::stringstream in(split);
  for (std::string part; std::getline(in, part, ',');) {
    double w = -1;
    std::size_t used = 0;
    try {
      w = std::stod(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != part.size() || !(w >= 0) || !std::isfinite(w) || weights.size() == 3)
      throw graphs::ConfigError(fmt::format(
          "--split '{}' must be up to three weights >= 0 for the train, validation and test "
          "parts, like 949,50,1",
          split));
    weights.push_back(w);
  }
  weights.resize(3, 0.0);
  const double sum = weights[0] + weights[1] + weights[2];
  if (!(weights[0] > 0))
    throw graphs::ConfigError(fmt::format(
        "--split '{}' leaves nothing to train on: give the first part a weight > 0", split));
  return weights[1] / sum;
}

}  // namespace

void add_train_flags(CLI::App& cmd, TrainOptions& o) {
  // --config's values come first on the command line; a flag given again overrides them.
  cmd.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto& m = o.config.model;
  auto& p = o.config.plan;
  cmd.add_option("--config", o.config_file,
                 "JSON file of flag names and values (flags given here win)");
  cmd.add_option("--num-layers", m.num_layers, "Transformer layers")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--hidden-size", m.hidden_size, "Width of the hidden states")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--num-attention-heads", m.num_attention_heads,
                 "Attention heads, each --hidden-size / heads wide")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--ffn-hidden-size", m.ffn_hidden_size,
                 "Width of the MLPs' (and experts') hidden layer")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--seq-length", m.seq_length, "Tokens per sample")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--max-position-embeddings", m.max_position_embeddings,
                 "Positions the position table holds (0: --seq-length)")
      ->capture_default_str();
  cmd.add_option("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by,
                 "Pad the vocabulary (256 byte tokens) to a multiple of this")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_flag("--swiglu", o.swiglu, "SwiGLU MLPs instead of GELU");
  cmd.add_option("--position-embedding-type", o.position_embedding_type,
                 "learned_absolute: a learned table added to the input; rope: rotary embeddings "
                 "of queries and keys; none")
      ->capture_default_str();
  cmd.add_flag("--use-rotary-position-embeddings", o.use_rotary_position_embeddings,
               "Megatron's older spelling of --position-embedding-type rope");
  cmd.add_flag("--no-position-embedding", o.no_position_embedding,
               "No learned position table (with neither rope: --position-embedding-type none)");
  cmd.add_option("--rotary-percent", m.rotary_percent,
                 "Share of each head's dimensions RoPE rotates, in (0, 1]")
      ->capture_default_str();
  cmd.add_option("--rotary-base", m.rotary_base, "RoPE's base: angle base^(-2i / dims) x position")
      ->capture_default_str();
  cmd.add_option("--normalization", o.normalization, "LayerNorm or RMSNorm, for every norm")
      ->capture_default_str();
  cmd.add_flag("--qk-layernorm", m.qk_layernorm,
               "Norm (per --normalization) each head's queries and keys before attention");
  cmd.add_option("--norm-epsilon,--layernorm-epsilon", m.layernorm_epsilon, "The norms' epsilon")
      ->check(positive())
      ->capture_default_str();
  cmd.add_flag("--group-query-attention", o.group_query_attention,
               "Grouped-query attention with --num-query-groups key/value heads");
  cmd.add_option("--num-query-groups", o.num_query_groups,
                 "Key/value heads with --group-query-attention, each shared by heads / groups "
                 "query heads")
      ->check(at_least(1));
  cmd.add_flag("--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights,
               "An output layer of its own instead of the word embedding's transpose");
  cmd.add_flag("--disable-bias-linear", o.disable_bias_linear,
               "No biases in the attention's and the MLPs' linear layers");
  cmd.add_option("--attention-dropout", m.attention_dropout,
                 "Dropout on the attention probabilities, in [0, 1)")
      ->capture_default_str();
  cmd.add_option("--hidden-dropout", m.hidden_dropout,
                 "Dropout after the attention and the MLP, in [0, 1)")
      ->capture_default_str();
  cmd.add_option("--init-method-std", m.init_method_std,
                 "Standard deviation of the initial weights")
      ->check(positive())
      ->capture_default_str();
  cmd.add_option("--num-experts", m.num_experts, "0: dense model")
      ->check(at_least(0))
      ->capture_default_str();
  cmd.add_option("--moe-layer-freq", m.moe_layer_freq, "A MoE layer every this many layers")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--moe-router-topk", m.moe_router_topk, "Experts each token is routed to")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--moe-aux-loss-coeff", m.moe_aux_loss_coeff,
                 "Weight of the load-balancing loss, >= 0")
      ->capture_default_str();
  cmd.add_option("--moe-z-loss-coeff", m.moe_z_loss_coeff, "Weight of the router's z-loss, >= 0")
      ->capture_default_str();
  cmd.add_option("--moe-expert-capacity-factor", m.moe_expert_capacity_factor, "0: dropless")
      ->capture_default_str();
  cmd.add_option("--seed", m.seed, "Seed of the initial weights, dropout and mock data")
      ->capture_default_str();
  cmd.add_option("--devices", o.devices, "Simulated devices (default: tp x cp x pp)")
      ->check(at_least(1));
  cmd.add_option("--tensor-model-parallel-size", p.tensor_parallel,
                 "Tensor-parallel ranks: each layer's matrices split over them")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_flag("--sequence-parallel", p.sequence_parallel,
               "With tensor parallelism: the norms and dropout split over the sequence too");
  cmd.add_option("--ampipe-degree", p.ampipe_degree,
                 "Sequence chunks pipelining attention with the MoE all-to-alls (Ampipe)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_flag("--ampipe-tp-sp-comm-overlap", p.ampipe_tp_sp_comm_overlap,
               "Pipeline the split experts' tensor-parallel all-gathers and reduce-scatters over "
               "(chunk, local expert) items (MindSpeed; needs --ampipe-degree > 1, "
               "--sequence-parallel, --moe-model-type deepspeed_moe and EP > 1)");
  cmd.add_flag("--ampipe-cp-resend-kv", p.ampipe_cp_resend_kv,
               "Under CP: send the key/value blocks round the ring again in backward instead of "
               "keeping them all from forward (less activation memory, cp - 1 more ring steps per "
               "layer under the MoE backward)");
  cmd.add_flag("--use-pipe-experts", p.pipe_experts,
               "Run each MoE slot as items (local expert x capacity slice), each with its own "
               "dispatch and combine all-to-all");
  cmd.add_flag("--pipe-experts-multi-stream", p.pipe_experts_multi_stream,
               "With --use-pipe-experts (MindSpeed's meaning): the items' all-to-alls and "
               "tensor-parallel all-gathers and reduce-scatters in one strict order, so expert- "
               "and tensor-parallel traffic never share the links; needs --sequence-parallel and "
               "--moe-model-type deepspeed_moe");
  cmd.add_flag("--pipe-experts-separate-streams", p.pipe_experts_separate_streams,
               "With --use-pipe-experts: the items' dispatches and combines on streams of their "
               "own (weave's)");
  cmd.add_option("--pipe-experts-multi-data", p.pipe_experts_multi_data,
                 "With --use-pipe-experts: capacity slices per expert (divided among Ampipe "
                 "chunks)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_flag("--ampipe-advise", o.ampipe_advise,
               "Instead of training: predict one step at each Ampipe degree as weave predict "
               "does (built without tensors, replicas folded, on the virtual clock of --link, "
               "--device-flops or --accelerator) and name the fastest that fits a device's "
               "memory");
  cmd.add_flag("--ampipe-advise-fast", o.ampipe_advise_fast,
               "Accepted for old scripts without effect: --ampipe-advise always predicts "
               "without running the kernels now, all-to-alls timed as for balanced routing");
  cmd.add_flag("--pipeline-advise", o.pipeline_advise,
               "Instead of training: predict one step under every pipeline schedule as weave "
               "predict does (--link, --device-flops or --accelerator): step time, bubble "
               "predicted and in theory, memory per device and activation memory per stage; "
               "the fastest that fits a device's memory named");
  // MindSpeed and Megatron switches scripts carry: accepted, refused beside Ampipe by its rules.
  cmd.add_flag("--overlap-grad-reduce", p.overlap_grad_reduce,
               "Accepted: gradient reductions always overlap the backward here (refused with "
               "Ampipe, as MindSpeed does)");
  cmd.add_flag("--overlap-param-gather", p.overlap_param_gather,
               "Accepted: the distributed optimizer's gathers run on their group's stream "
               "(refused with Ampipe, as MindSpeed does)");
  cmd.add_flag("--use-flash-attn", p.use_flash_attn,
               "Accepted: attention is always blockwise with online softmax here");
  cmd.add_flag("--use-nanopipe", p.use_nanopipe,
               "Accepted without effect (refused with Ampipe, as MindSpeed does)");
  cmd.add_flag("--recompute-in-bubble", p.recompute_in_bubble,
               "Accepted without effect (refused with Ampipe, as MindSpeed does)");
  cmd.add_flag("--recompute-in-advance", p.recompute_in_advance,
               "Accepted without effect (refused with Ampipe, as MindSpeed does)");
  cmd.add_flag("--adaptive-recompute-device-swap", p.adaptive_recompute_device_swap,
               "Accepted without effect (refused with Ampipe, as MindSpeed does)");
  cmd.add_flag("--use-distributed-optimizer", p.distributed_optimizer,
               "Shard optimizer state over data-parallel replicas (reduce-scatter + all-gather)");
  cmd.add_option("--context-parallel-size", p.context_parallel,
                 "Context-parallel ranks: each sample's sequence split over them (ring attention)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--expert-model-parallel-size", p.expert_parallel,
                 "Expert-parallel ranks: the experts divided among them")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--expert-tensor-parallel-size", p.expert_tensor_parallel,
                 "1: every expert whole on one rank; the tensor-parallel size: every expert split "
                 "over the tensor-parallel group (fc1 by columns, fc2 by rows)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--moe-model-type", p.moe_model_type,
                 "megatron (experts whole) or deepspeed_moe (MindSpeed's layout: experts split "
                 "over the tensor-parallel group, expert-parallel groups of one tp rank)");
  cmd.add_option("--pipeline-model-parallel-size", p.pipeline_parallel,
                 "Pipeline stages: the layers divided among them")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--pipeline-scheduler", p.pipeline_scheduler,
                 "gpipe, 1f1b, interleaved, interleaved-mem, zb-h1 or zb-v (default: 1f1b, "
                 "interleaved with virtual stages); `weave schedule` draws them");
  cmd.add_option("--num-layers-per-virtual-pipeline-stage", p.layers_per_virtual_stage,
                 "Layers per model chunk: chunks per pipeline rank = layers / (pp x this)")
      ->check(at_least(1));
  cmd.add_option("--virtual-pipeline-model-parallel-size", p.virtual_pipeline,
                 "Model chunks per pipeline rank (instead of "
                 "--num-layers-per-virtual-pipeline-stage)")
      ->check(at_least(1));
  cmd.add_option("--microbatch-group-size-per-virtual-pipeline-stage", p.microbatch_group_size,
                 "Interleaved schedule: micro-batches run on one chunk before the next (default: "
                 "pp)")
      ->check(at_least(1));
  cmd.add_option("--decoder-first-pipeline-num-layers", p.first_stage_layers,
                 "Layers of the first model chunk (the rest split evenly)")
      ->check(at_least(1));
  cmd.add_option("--decoder-last-pipeline-num-layers", p.last_stage_layers,
                 "Layers of the last model chunk (the rest split evenly)")
      ->check(at_least(1));
  cmd.add_option("--micro-batch-size", p.micro_batch_size, "Samples per micro-batch")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--global-batch-size", p.global_batch_size,
                 "Default: micro-batch x data-parallel size")
      ->check(at_least(1));
  cmd.add_option("--train-iters", o.config.train_iters, "Iterations to train")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--lr", o.config.learning_rate.lr, "Peak learning rate")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd.add_option("--min-lr", o.config.learning_rate.min_lr,
                 "Learning rate at the end of the decay, at most --lr")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd.add_option("--lr-warmup-iters", o.config.learning_rate.warmup_iters,
                 "Iterations of linear warm-up from 0 to --lr")
      ->check(at_least(0))
      ->capture_default_str();
  cmd.add_option("--lr-decay-iters", o.config.learning_rate.decay_iters, "Default: --train-iters")
      ->check(at_least(0));
  cmd.add_option("--lr-decay-style", o.config.learning_rate.style,
                 "Decay from --lr to --min-lr after the warm-up")
      ->check(CLI::IsMember({"cosine", "linear", "constant"}))
      ->capture_default_str();
  cmd.add_option("--weight-decay", o.config.optimizer.adamw.weight_decay,
                 "AdamW's decoupled weight decay")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd.add_option("--optimizer", o.optimizer,
                 "adam: weave's optimizer is AdamW (Megatron's adam, decoupled weight decay)")
      ->check(CLI::IsMember({"adam"}))
      ->capture_default_str();
  cmd.add_option("--adam-beta1", o.config.optimizer.adamw.beta1,
                 "AdamW's first-moment decay, in [0, 1)")
      ->capture_default_str();
  cmd.add_option("--adam-beta2", o.config.optimizer.adamw.beta2,
                 "AdamW's second-moment decay, in [0, 1)")
      ->capture_default_str();
  cmd.add_option("--adam-eps", o.config.optimizer.adamw.eps, "AdamW's epsilon, > 0")
      ->capture_default_str();
  cmd.add_option("--clip-grad", o.config.optimizer.clip_grad, "0: no clipping")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd.add_option("--data-path", o.data_path, "A text file or a folder of them (byte tokens)")
      ->capture_default_str();
  cmd.add_option("--split", o.split,
                 "Weights of the text's train, validation and test parts, like 949,50,1: the "
                 "validation share is held out (default: 5 %); there is no test evaluation");
  cmd.add_flag("--mock-data", o.mock_data, "Synthetic tokens instead of --data-path");
  cmd.add_option("--save", o.config.save_path, "Checkpoint file to write");
  cmd.add_option("--load", o.config.load_path, "Checkpoint file to resume from");
  cmd.add_option("--save-interval", o.config.save_interval,
                 "With --save: also save every this many iterations")
      ->check(at_least(0));
  cmd.add_option("--eval-interval", o.config.eval_interval,
                 "Evaluate on the held-out text every this many iterations")
      ->check(at_least(0));
  cmd.add_option("--eval-iters", o.config.eval_iters, "Global batches each evaluation averages")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--log-interval", o.config.metrics_interval,
                 "A progress line (and the communication measured) every this many iterations")
      ->check(at_least(1))
      ->capture_default_str();
  cmd.add_option("--log-json", o.log_json, "Write metrics as JSON lines to this file");
  cmd.add_option("--trace", o.config.trace_path, "Write the Chrome trace of one iteration here");
  cmd.add_option("--trace-iteration", o.config.trace_iteration,
                 "Which iteration --trace records (default: 2, or the last of a shorter run)")
      ->check(at_least(1))
      ->each([&o](const std::string&) { o.trace_iteration_given = true; })
      ->capture_default_str();
  cmd.add_option("--dump-graph", o.dump_graph, "Write the step's task graph as GraphViz DOT here");
  cmd.add_option("--timing", o.timing, "wall: real threads; model: the virtual clock")
      ->check(CLI::IsMember({"wall", "model"}))
      ->capture_default_str();
  cmd.add_option("--link", o.config.machine.link,
                 "Link model: a preset (see `weave topo --links`) or GBPS:MICROSECONDS")
      ->capture_default_str();
  cmd.add_option("--accelerator", o.accelerator,
                 "Model the devices as this accelerator (--timing model, weave predict): a "
                 "preset (a100-80gb, h100-sxm, ascend-910b) or a JSON file (weave calibrate "
                 "writes this host's); prices matrix products by their shapes, attention and "
                 "streaming at the rates it states (--device-flops and --device-memory-bandwidth "
                 "given are overridden), --link to its node's link unless --link is given, and the "
                 "cluster "
                 "collectives are costed on: its node and network (--devices-per-node, "
                 "--node-link, --network override them)");
  cmd.add_option("--devices-per-node", o.cluster.devices_per_node,
                 "Devices in a node of the modelled cluster (--timing model, weave predict): "
                 "rank r sits on node r / N (default: the --accelerator's)")
      ->check(at_least(1))
      ->type_name("N");
  cmd.add_option("--node-link", o.cluster.node_link,
                 "The modelled cluster's link between the devices of a node, GBPS:MICROSECONDS "
                 "per device (default: the --accelerator's)")
      ->type_name("GBPS:US");
  cmd.add_option("--network", o.cluster.network,
                 "The modelled cluster's network between nodes, GBPS:MICROSECONDS of each "
                 "device's NIC (default: the --accelerator's)")
      ->type_name("GBPS:US");
  cmd.add_option("--device-memory-bandwidth", o.config.machine.device_memory_bandwidth,
                 "Modelled bytes/s a device streams (--timing model): prices norms, residuals, "
                 "dropout and the optimizer")
      ->check(positive())
      ->capture_default_str();
  cmd.add_option("--device-flops", o.config.machine.device_flops,
                 "Modelled FLOP/s of a device (--timing model)")
      ->check(positive())
      ->capture_default_str();
  // Megatron-LM's and MindSpeed's flags that mean nothing here: parsed, values and all, and
  // named once when the run starts. Those registered above for a rule of their own (MindSpeed's
  // Ampipe refuses them) are reported the same way.
  for (const MegatronFlag& f : no_effect_flags()) {
    const std::string name(f.name);
    CLI::Option* opt = cmd.get_option_no_throw(name);
    if (!opt)
      opt = f.values == 0 ? cmd.add_flag(name)
                          : cmd.add_option(name)->expected(f.values)->type_name("VALUE");
    opt->description(std::string(f.why));
    opt->group("Megatron-LM and MindSpeed flags accepted without effect");
    opt->each([&o, name](const std::string&) {
      if (std::find(o.no_effect.begin(), o.no_effect.end(), name) == o.no_effect.end())
        o.no_effect.push_back(name);
    });
  }
}

namespace {

// The cluster's rules break as configuration errors, as every other flag's do.
template <typename Build>
devices::Cluster cluster_or_refuse(Build build) {
  try {
    return build();
  } catch (const std::invalid_argument& e) {
    throw graphs::ConfigError(e.what());
  }
}

}  // namespace

void derive_config(TrainOptions& o) {
  graphs::TrainerConfig& c = o.config;
  c.model.activation = o.swiglu ? graphs::Activation::swiglu : graphs::Activation::gelu;
  if (!o.accelerator.empty()) {
    const devices::Accelerator a = devices::Accelerator::load(o.accelerator);
    c.machine.device_flops = a.sustained_flops();
    c.machine.device_memory_bandwidth = a.sustained_memory_bandwidth();
    c.machine.peak_flops = a.peak_flops;
    c.machine.attention_flops = a.sustained_attention_flops();
    c.machine.attention_backward_flops = a.sustained_attention_backward_flops();
    c.machine.matmul_overhead_dimension = a.matmul_overhead_dimension;
    if (c.machine.link == "none")
      c.machine.link =
          fmt::format("{}:{}", a.node_link.bytes_per_second / 1e9, a.node_link.latency_us);
    c.machine.cluster =
        cluster_or_refuse([&] { return devices::Cluster::from_accelerator(a, o.cluster); });
  } else if (o.cluster.any()) {
    c.machine.cluster =
        cluster_or_refuse([&] { return devices::Cluster::from_overrides(o.cluster); });
  }
  if (o.position_embedding_type == "learned_absolute")
    c.model.position_embedding = graphs::PositionEmbedding::learned_absolute;
  else if (o.position_embedding_type == "rope")
    c.model.position_embedding = graphs::PositionEmbedding::rope;
  else if (o.position_embedding_type == "none")
    c.model.position_embedding = graphs::PositionEmbedding::none;
  else
    throw graphs::ConfigError(fmt::format(
        "--position-embedding-type must be learned_absolute, rope or none (Megatron-LM's "
        "choices), got '{}'",
        o.position_embedding_type));
  if (o.normalization == "LayerNorm")
    c.model.normalization = graphs::Normalization::layer_norm;
  else if (o.normalization == "RMSNorm")
    c.model.normalization = graphs::Normalization::rms_norm;
  else
    throw graphs::ConfigError(fmt::format(
        "--normalization must be LayerNorm or RMSNorm (spelt as Megatron-LM spells them), got '{}'",
        o.normalization));
  if (o.use_rotary_position_embeddings)
    c.model.position_embedding = graphs::PositionEmbedding::rope;
  else if (o.no_position_embedding &&
           c.model.position_embedding == graphs::PositionEmbedding::learned_absolute)
    c.model.position_embedding = graphs::PositionEmbedding::none;
  if (o.num_query_groups > 0 && !o.group_query_attention)
    throw graphs::ConfigError(fmt::format(
        "--num-query-groups ({}) applies with --group-query-attention, as in Megatron-LM: add "
        "--group-query-attention, or drop --num-query-groups",
        o.num_query_groups));
  if (o.group_query_attention && o.num_query_groups == 0)
    throw graphs::ConfigError(
        "--group-query-attention needs --num-query-groups: the number of key/value heads");
  c.model.num_query_groups = o.group_query_attention ? o.num_query_groups : 0;
  c.model.add_bias_linear = !o.disable_bias_linear;
  graphs::ParallelPlan& plan = c.plan;
  // One factor at a time, each product checked before the next multiplication.
  long long model_parallel = 1;
  for (const int size : {plan.tensor_parallel, plan.context_parallel, plan.pipeline_parallel}) {
    model_parallel *= size;
    if (model_parallel > graphs::kMaxDevices)
      throw graphs::ConfigError(fmt::format(
          "tensor x context x pipeline parallel ({} x {} x {}) exceeds {} devices, more than "
          "weave lays out: lower the parallel sizes",
          plan.tensor_parallel, plan.context_parallel, plan.pipeline_parallel,
          graphs::kMaxDevices));
  }
  if (o.devices == 0) o.devices = static_cast<int>(model_parallel);
  if (o.devices % model_parallel != 0)
    throw graphs::ConfigError(fmt::format(
        "--devices ({}) must be a multiple of tensor x context x pipeline parallel ({}): the rest "
        "is data parallelism",
        o.devices, model_parallel));
  plan.data_parallel = static_cast<int>(o.devices / model_parallel);
  if (plan.global_batch_size == 0) {
    const long long per_step = 1LL * plan.micro_batch_size * plan.data_parallel;
    if (per_step > std::numeric_limits<int>::max())
      throw graphs::ConfigError(fmt::format(
          "--micro-batch-size {} x data-parallel size {} is more samples than a step can hold: "
          "lower them",
          plan.micro_batch_size, plan.data_parallel));
    plan.global_batch_size = static_cast<int>(per_step);
  }
  c.timing = o.timing == "model" ? graphs::Timing::virtual_clock : graphs::Timing::wall;
  if (!o.trace_iteration_given) c.trace_iteration = std::min(c.trace_iteration, c.train_iters);
  if (!o.split.empty()) o.valid_fraction = validation_share(o.split);
}

std::int64_t modelled_device_memory(const TrainOptions& o, double given_gib) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  if (given_gib > 0) return static_cast<std::int64_t>(given_gib * kGiB);
  if (!o.accelerator.empty()) return devices::Accelerator::load(o.accelerator).memory_bytes;
  return static_cast<std::int64_t>(80 * kGiB);
}

}  // namespace weave::cli
