// `weave train`: trains the GPT-MoE model over simulated devices with Megatron-LM's flags. The
// training loop is graphs::Trainer; this file turns flags into its configuration and its
// callbacks into progress lines.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "commands.hpp"
#include "progress_reporter.hpp"
#include "train_advice.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/mpi_communicator.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/trainer.hpp"
#include "weave/runtime/dot_writer.hpp"

namespace weave::cli {

namespace {

// The Debian package `fortunes` (installed by tools/dev) puts its text here.
constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes";

struct TrainOptions {
  // global_batch_size 0: micro-batch x data-parallel size
  graphs::TrainerConfig config{.plan = {.global_batch_size = 0}};
  bool swiglu = false;
  int devices = 0;  // 0: tp x cp x pp (one data-parallel replica)
  std::string data_path = kDefaultCorpus;
  bool mock_data = false;
  double valid_fraction = 0.05;
  std::string log_json, dump_graph;
  std::string timing = "wall";
  std::string config_file;  // read before parsing (see prepare_arguments)
  bool ampipe_advise = false;
  bool ampipe_advise_fast = false;  // replay without running the kernels
  bool pipeline_advise = false;
};

// The flags' meaning that is the command line's own: --devices sets the data-parallel size, a
// missing --global-batch-size is one micro-batch per replica, --swiglu and --timing are words.
void derive_config(TrainOptions& o) {
  graphs::TrainerConfig& c = o.config;
  c.model.activation = o.swiglu ? graphs::Activation::swiglu : graphs::Activation::gelu;
  graphs::ParallelPlan& plan = c.plan;
  const int model_parallel = plan.tensor_parallel * plan.context_parallel * plan.pipeline_parallel;
  if (o.devices == 0) o.devices = model_parallel;
  if (o.devices % model_parallel != 0)
    throw graphs::ConfigError(fmt::format(
        "--devices ({}) must be a multiple of tensor x context x pipeline parallel ({}): the rest "
        "is data parallelism",
        o.devices, model_parallel));
  plan.data_parallel = o.devices / model_parallel;
  if (plan.global_batch_size == 0)
    plan.global_batch_size = plan.micro_batch_size * plan.data_parallel;
  c.timing = o.timing == "model" ? graphs::Timing::virtual_clock : graphs::Timing::wall;
}

// The run's first line: the model, the split over devices, the batch and the data.
std::string describe(const graphs::TrainerConfig& c, const std::string& data) {
  const graphs::ModelConfig& m = c.model;
  const graphs::ParallelPlan& plan = c.plan;
  return fmt::format(
      "weave train: {} layers, hidden {}, {} heads, {}{} | {} devices: tp {}{}, cp {}, ep {}, dp "
      "{}{}{} | micro-batch {}, global batch {} ({} micro-batches) | data: {}",
      m.num_layers, m.hidden_size, m.num_attention_heads,
      m.num_experts > 0 ? fmt::format("{} experts top-{}", m.num_experts, m.moe_router_topk)
                        : "dense",
      m.activation == graphs::Activation::swiglu ? ", SwiGLU" : "", plan.devices(),
      plan.tensor_parallel, plan.sequence_parallel ? " + sp" : "", plan.context_parallel,
      plan.expert_parallel, plan.data_parallel,
      plan.ampipe_degree > 1 ? fmt::format(", ampipe {}", plan.ampipe_degree) : "",
      plan.pipeline_parallel > 1
          ? fmt::format(", pp {} ({}{})", plan.pipeline_parallel,
                        graphs::schedule_name(graphs::pipeline_schedule_kind(plan)),
                        plan.virtual_pipeline > 1
                            ? fmt::format(", {} chunks per rank", plan.virtual_pipeline)
                            : "")
          : "",
      plan.micro_batch_size, plan.global_batch_size, plan.micro_batches(), data);
}

// This process's place in an MPI job, from the launcher's environment (0 without one).
int launched_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(name)) return std::atoi(v);
  return 0;
}

// A run over the processes of an MPI job: the communicator and this process's devices, laid out
// on its own cores.
struct ProcessRun {
  explicit ProcessRun(int devices, bool pin) : comm(devices) {
    devices::Topology topology = devices::Topology::detect();
    const std::vector<int> cores = comm.cores(topology);
    set = std::make_unique<devices::DeviceSet>(
        std::move(topology), devices,
        devices::DeviceSetOptions{.pin = pin, .held = comm.held_devices(), .cores = cores});
  }
  devices::MpiCommunicator comm;
  std::unique_ptr<devices::DeviceSet> set;
};

int train(TrainOptions& o, ProgressReporter& progress, ProcessRun* processes);
int run_trainer(TrainOptions& o, ProgressReporter& progress, graphs::Trainer& trainer);

int run_train(TrainOptions o) {
  derive_config(o);
  graphs::TrainerConfig& c = o.config;
  if (o.ampipe_advise_fast && !o.ampipe_advise)
    throw std::invalid_argument(
        "--ampipe-advise-fast changes how --ampipe-advise replays: add --ampipe-advise");
  // Under mpirun every process runs this; until training starts they all meet the same errors,
  // which process 0 alone reports.
  const bool launched = devices::MpiCommunicator::launched();
  const bool first = launched_rank() == 0;
  std::unique_ptr<ProcessRun> processes;
  std::unique_ptr<ProgressReporter> progress;
  try {
    if (launched && (o.ampipe_advise || o.pipeline_advise))
      throw std::invalid_argument(
          "--ampipe-advise and --pipeline-advise replay steps on the virtual clock in one "
          "process: run them without mpirun");
    const std::vector<std::string> warnings = graphs::validate(c);
    if (launched) processes = std::make_unique<ProcessRun>(c.plan.devices(), c.pin_devices);
    progress =
        std::make_unique<ProgressReporter>(c.train_iters, c.metrics_interval, o.log_json, first);
    for (const std::string& w : warnings)
      progress->note("warning: " + w);
  } catch (const std::exception&) {
    if (!first) throw CommandExit{1};
    throw;
  }
  return train(o, *progress, processes.get());
}

int train(TrainOptions& o, ProgressReporter& progress, ProcessRun* processes) {
  graphs::TrainerConfig& c = o.config;
  const bool first = launched_rank() == 0;
  graphs::TrainingData data = graphs::TrainingData::from(
      o.mock_data
          ? graphs::TokenDataset::mock(c.model.seq_length, c.model.seed)
          : graphs::TokenDataset::from_text(o.data_path, c.model.seq_length, o.valid_fraction));
  if (o.ampipe_advise) return advise_ampipe(c, data.train, o.ampipe_advise_fast);
  if (o.pipeline_advise) return advise_pipeline(c, data.train);

  std::unique_ptr<graphs::Trainer> built;
  try {
    built = processes ? std::make_unique<graphs::Trainer>(c, std::move(data), *processes->set,
                                                          processes->comm)
                      : std::make_unique<graphs::Trainer>(c, std::move(data));
  } catch (const std::exception&) {
    if (!first) throw CommandExit{1};
    throw;
  }
  graphs::Trainer& trainer = *built;
  const int process_count = trainer.processes().size();
  if (process_count > 1)
    progress.note(fmt::format("{} processes of {} device{} each (mpirun -np {})", process_count,
                              c.plan.devices() / process_count,
                              c.plan.devices() / process_count == 1 ? "" : "s", process_count));
  try {
    return run_trainer(o, progress, trainer);
  } catch (const std::exception& e) {
    if (process_count == 1) throw;
    // The other processes may be waiting for this one: say why, then end the job.
    fmt::print(stderr, "weave: error: process {}: {}\n", trainer.processes().index(), e.what());
    std::fflush(stderr);
    processes->comm.abort(1);
  }
}

int run_trainer(TrainOptions& o, ProgressReporter& progress, graphs::Trainer& trainer) {
  graphs::TrainerConfig& c = o.config;
  progress.note(describe(trainer.config(), trainer.data().description));
  if (!o.dump_graph.empty() && trainer.processes().index() == 0) {
    std::ofstream dot(o.dump_graph);
    rt::write_dot(trainer.step().graph(), dot);
    progress.note(
        fmt::format("graph: {} tasks, written to {}", trainer.step().graph().size(), o.dump_graph));
  }
  if (!c.load_path.empty())
    progress.note(fmt::format("resumed from {} at iteration {}", c.load_path, trainer.iteration()));

  const graphs::TrainingSummary done = trainer.run(
      {.iteration =
           [&](const graphs::IterationMetrics& m) {
             progress.iteration(m);
             return graphs::TrainingControl::proceed;
           },
       .validation =
           [&](const graphs::ValidationResult& v) { progress.validation(v.iteration, v.loss); },
       .saved =
           [&](const std::string& path, std::int64_t iteration) {
             progress.note(fmt::format("saved {} (iteration {})", path, iteration));
           }});
  progress.finish();
  if (done.seconds > 0)
    progress.note(fmt::format(
        "done: loss {:.4f} -> {:.4f} | {:.0f} tokens/s {} | {:.1f} GFLOP/s of model math{}",
        done.first_loss, done.last_loss, done.tokens_per_second,
        c.timing == graphs::Timing::virtual_clock ? "(modelled)" : "(wall)", done.gflops_per_second,
        c.trace_path.empty()
            ? ""
            : fmt::format(" | trace of iteration {}: {}", c.trace_iteration, c.trace_path)));
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the GPT-MoE model over simulated devices");
  // --config's values come first on the command line; a flag given again overrides them.
  cmd->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto& m = o->config.model;
  auto& p = o->config.plan;
  cmd->add_option("--config", o->config_file,
                  "JSON file of flag names and values (flags given here win)");
  cmd->add_option("--num-layers", m.num_layers)->check(at_least(1))->capture_default_str();
  cmd->add_option("--hidden-size", m.hidden_size)->check(at_least(1))->capture_default_str();
  cmd->add_option("--num-attention-heads", m.num_attention_heads)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--ffn-hidden-size", m.ffn_hidden_size)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--seq-length", m.seq_length)->check(at_least(1))->capture_default_str();
  cmd->add_option("--max-position-embeddings", m.max_position_embeddings)->capture_default_str();
  cmd->add_option("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_flag("--swiglu", o->swiglu, "SwiGLU MLPs instead of GELU");
  cmd->add_option("--hidden-dropout", m.hidden_dropout)->capture_default_str();
  cmd->add_option("--init-method-std", m.init_method_std)->check(positive())->capture_default_str();
  cmd->add_option("--num-experts", m.num_experts, "0: dense model")
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--moe-layer-freq", m.moe_layer_freq)->check(at_least(1))->capture_default_str();
  cmd->add_option("--moe-router-topk", m.moe_router_topk)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--moe-aux-loss-coeff", m.moe_aux_loss_coeff)->capture_default_str();
  cmd->add_option("--moe-z-loss-coeff", m.moe_z_loss_coeff)->capture_default_str();
  cmd->add_option("--moe-expert-capacity-factor", m.moe_expert_capacity_factor, "0: dropless")
      ->capture_default_str();
  cmd->add_option("--seed", m.seed)->capture_default_str();
  cmd->add_option("--devices", o->devices, "Simulated devices (default: tp x cp x pp)")
      ->check(at_least(1));
  cmd->add_option("--tensor-model-parallel-size", p.tensor_parallel)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_flag("--sequence-parallel", p.sequence_parallel);
  cmd->add_option("--ampipe-degree", p.ampipe_degree,
                  "Sequence chunks pipelining attention with the MoE all-to-alls (Ampipe)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_flag("--ampipe-tp-sp-comm-overlap", p.ampipe_tp_sp_comm_overlap,
                "Pipeline the experts' tensor-parallel collectives (MindSpeed; switched off with a "
                "warning: weave's experts are not tensor-parallel)");
  cmd->add_flag("--use-pipe-experts", p.pipe_experts,
                "Run each MoE slot as items (local expert x capacity slice), each with its own "
                "dispatch and combine all-to-all");
  cmd->add_flag("--pipe-experts-multi-stream", p.pipe_experts_multi_stream,
                "With --use-pipe-experts (MindSpeed's meaning): the items' all-to-alls and "
                "tensor-parallel all-gathers and reduce-scatters in one strict order, so expert- "
                "and tensor-parallel traffic never share the links; needs --sequence-parallel and "
                "--moe-model-type deepspeed_moe");
  cmd->add_flag("--pipe-experts-separate-streams", p.pipe_experts_separate_streams,
                "With --use-pipe-experts: the items' dispatches and combines on streams of their "
                "own (weave's)");
  cmd->add_option("--pipe-experts-multi-data", p.pipe_experts_multi_data,
                  "With --use-pipe-experts: capacity slices per expert (divided among Ampipe "
                  "chunks)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_flag("--ampipe-advise", o->ampipe_advise,
                "Instead of training: replay one step at each Ampipe degree on the virtual clock "
                "(--link, --device-flops) and name the fastest");
  cmd->add_flag("--ampipe-advise-fast", o->ampipe_advise_fast,
                "With --ampipe-advise: replay without running the kernels, all-to-alls timed as "
                "for balanced routing (for many devices)");
  cmd->add_flag("--pipeline-advise", o->pipeline_advise,
                "Instead of training: replay one step under every pipeline schedule on the "
                "virtual clock (--link, --device-flops): step time, bubble measured and in "
                "theory, activation memory per stage");
  // MindSpeed and Megatron switches scripts carry: accepted, refused beside Ampipe by its rules.
  cmd->add_flag("--overlap-grad-reduce", p.overlap_grad_reduce,
                "Accepted: gradient reductions always overlap the backward here (refused with "
                "Ampipe, as MindSpeed does)");
  cmd->add_flag("--overlap-param-gather", p.overlap_param_gather,
                "Accepted: the distributed optimizer's gathers run on their group's stream "
                "(refused with Ampipe, as MindSpeed does)");
  cmd->add_flag("--use-flash-attn", p.use_flash_attn,
                "Accepted: attention is always blockwise with online softmax here");
  cmd->add_flag("--use-nanopipe", p.use_nanopipe,
                "Accepted without effect (refused with Ampipe, as MindSpeed does)");
  cmd->add_flag("--recompute-in-bubble", p.recompute_in_bubble,
                "Accepted without effect (refused with Ampipe, as MindSpeed does)");
  cmd->add_flag("--recompute-in-advance", p.recompute_in_advance,
                "Accepted without effect (refused with Ampipe, as MindSpeed does)");
  cmd->add_flag("--adaptive-recompute-device-swap", p.adaptive_recompute_device_swap,
                "Accepted without effect (refused with Ampipe, as MindSpeed does)");
  cmd->add_flag("--use-distributed-optimizer", p.distributed_optimizer,
                "Shard optimizer state over data-parallel replicas (reduce-scatter + all-gather)");
  cmd->add_option("--context-parallel-size", p.context_parallel)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--expert-model-parallel-size", p.expert_parallel)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--expert-tensor-parallel-size", p.expert_tensor_parallel,
                  "1: every expert whole on one rank; the tensor-parallel size: every expert split "
                  "over the tensor-parallel group (fc1 by columns, fc2 by rows)")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--moe-model-type", p.moe_model_type,
                  "megatron (experts whole) or deepspeed_moe (MindSpeed's layout: experts split "
                  "over the tensor-parallel group, expert-parallel groups of one tp rank)");
  cmd->add_option("--pipeline-model-parallel-size", p.pipeline_parallel)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--pipeline-scheduler", p.pipeline_scheduler,
                  "gpipe, 1f1b, interleaved, interleaved-mem, zb-h1 or zb-v (default: 1f1b, "
                  "interleaved with virtual stages); `weave schedule` draws them");
  cmd->add_option("--num-layers-per-virtual-pipeline-stage", p.layers_per_virtual_stage,
                  "Layers per model chunk: chunks per pipeline rank = layers / (pp x this)")
      ->check(at_least(1));
  cmd->add_option("--virtual-pipeline-model-parallel-size", p.virtual_pipeline,
                  "Model chunks per pipeline rank (instead of "
                  "--num-layers-per-virtual-pipeline-stage)")
      ->check(at_least(1));
  cmd->add_option("--microbatch-group-size-per-virtual-pipeline-stage", p.microbatch_group_size,
                  "Interleaved schedule: micro-batches run on one chunk before the next (default: "
                  "pp)")
      ->check(at_least(1));
  cmd->add_option("--decoder-first-pipeline-num-layers", p.first_stage_layers,
                  "Layers of the first model chunk (the rest split evenly)")
      ->check(at_least(1));
  cmd->add_option("--decoder-last-pipeline-num-layers", p.last_stage_layers,
                  "Layers of the last model chunk (the rest split evenly)")
      ->check(at_least(1));
  cmd->add_option("--micro-batch-size", p.micro_batch_size)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--global-batch-size", p.global_batch_size,
                  "Default: micro-batch x data-parallel size")
      ->check(at_least(1));
  cmd->add_option("--train-iters", o->config.train_iters)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--lr", o->config.learning_rate.lr)
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--min-lr", o->config.learning_rate.min_lr)
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--lr-warmup-iters", o->config.learning_rate.warmup_iters)
      ->check(at_least(0))
      ->capture_default_str();
  cmd->add_option("--lr-decay-iters", o->config.learning_rate.decay_iters, "Default: --train-iters")
      ->check(at_least(0));
  cmd->add_option("--lr-decay-style", o->config.learning_rate.style)
      ->check(CLI::IsMember({"cosine", "linear", "constant"}))
      ->capture_default_str();
  cmd->add_option("--weight-decay", o->config.optimizer.adamw.weight_decay)
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--adam-beta1", o->config.optimizer.adamw.beta1)->capture_default_str();
  cmd->add_option("--adam-beta2", o->config.optimizer.adamw.beta2)->capture_default_str();
  cmd->add_option("--adam-eps", o->config.optimizer.adamw.eps)->capture_default_str();
  cmd->add_option("--clip-grad", o->config.optimizer.clip_grad, "0: no clipping")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--data-path", o->data_path, "A text file or a folder of them (byte tokens)")
      ->capture_default_str();
  cmd->add_flag("--mock-data", o->mock_data, "Synthetic tokens instead of --data-path");
  cmd->add_option("--save", o->config.save_path, "Checkpoint file to write");
  cmd->add_option("--load", o->config.load_path, "Checkpoint file to resume from");
  cmd->add_option("--save-interval", o->config.save_interval)->check(at_least(0));
  cmd->add_option("--eval-interval", o->config.eval_interval)->check(at_least(0));
  cmd->add_option("--eval-iters", o->config.eval_iters)->check(at_least(1))->capture_default_str();
  cmd->add_option("--log-interval", o->config.metrics_interval)
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--log-json", o->log_json, "Write metrics as JSON lines to this file");
  cmd->add_option("--trace", o->config.trace_path, "Write the Chrome trace of one iteration here");
  cmd->add_option("--trace-iteration", o->config.trace_iteration, "Which iteration --trace records")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->add_option("--dump-graph", o->dump_graph,
                  "Write the step's task graph as GraphViz DOT here");
  cmd->add_option("--timing", o->timing, "wall: real threads; model: the virtual clock")
      ->check(CLI::IsMember({"wall", "model"}))
      ->capture_default_str();
  cmd->add_option("--link", o->config.machine.link,
                  "Link model: a preset (see `weave topo --links`) or GBPS:MICROSECONDS")
      ->capture_default_str();
  cmd->add_option("--device-flops", o->config.machine.device_flops,
                  "Modelled FLOP/s of a device (--timing model)")
      ->check(positive())
      ->capture_default_str();
  cmd->callback([o] { throw CommandExit{run_train(*o)}; });
}

}  // namespace weave::cli
