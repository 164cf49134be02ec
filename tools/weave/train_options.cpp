#include "train_options.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <string_view>
#include <utility>

#include "commands.hpp"
#include "sharding_flags.hpp"
#include "weave/devices/accelerator.hpp"
#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/moe_layer_freq.hpp"
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

// The cluster's rules break as configuration errors, as every other flag's do.
template <typename Build>
devices::Cluster cluster_or_refuse(Build build) {
  try {
    return build();
  } catch (const std::invalid_argument& e) {
    throw graphs::ConfigError(e.what());
  }
}

// The attention's rates on --accelerator for the run's backend, head dimension and the sequence a
// kernel call sees (a context-parallel rank's chunk against a chunk of keys at a time): the
// backend's measured kernel where the preset has one (Accelerator::sustained_attention_flops).
void derive_attention_rates(TrainOptions& o) {
  if (o.accelerator.empty()) return;
  const devices::Accelerator a = devices::Accelerator::load(o.accelerator);
  const graphs::ModelConfig& m = o.config.model;
  const std::string backend = graphs::attention_backend_name(m.attention_backend);
  const double sequence =
      static_cast<double>(m.seq_length) / std::max(o.config.plan.context_parallel, 1);
  graphs::ModelledMachine& machine = o.config.machine;
  machine.attention_flops = a.sustained_attention_flops(backend, m.head_dim(), sequence, false);
  machine.attention_backward_flops =
      a.sustained_attention_flops(backend, m.head_dim(), sequence, true);
}

// --accelerator's rates, link and cluster, or the cluster the flags give, into the machine.
void derive_machine(TrainOptions& o) {
  graphs::ModelledMachine& machine = o.config.machine;
  if (o.accelerator.empty()) {
    if (o.cluster.any())
      machine.cluster =
          cluster_or_refuse([&] { return devices::Cluster::from_overrides(o.cluster); });
    return;
  }
  const devices::Accelerator a = devices::Accelerator::load(o.accelerator);
  machine.device_flops = a.sustained_flops();
  machine.device_memory_bandwidth = a.sustained_memory_bandwidth();
  machine.peak_flops = a.peak_flops;
  machine.attention_flops = a.sustained_attention_flops();
  machine.attention_backward_flops = a.sustained_attention_backward_flops();
  machine.matmul_overhead_dimension = a.matmul_overhead_dimension;
  machine.kernel_launch_seconds = a.kernel_launch_us * 1e-6;
  if (machine.link == "none")
    machine.link = fmt::format("{}:{}", a.node_link.bytes_per_second / 1e9, a.node_link.latency_us);
  machine.cluster =
      cluster_or_refuse([&] { return devices::Cluster::from_accelerator(a, o.cluster); });
}

// --moe-router-load-balancing-type by Megatron-Core's meanings; MindSpeed's deepspeed_moe gate
// never reads it.
void derive_load_balancing(const std::string& type, graphs::ModelConfig& m) {
  if (m.moe_gate == graphs::MoeGate::deepspeed || type == "aux_loss") return;
  if (type == "none") {
    m.moe_aux_loss_coeff = 0;  // Megatron-Core adds no balancing loss whatever the coefficient
    return;
  }
  m.moe_load_balancing = type == "sinkhorn" ? graphs::MoeLoadBalancing::sinkhorn
                                            : graphs::MoeLoadBalancing::seq_aux_loss;
}

// The model's words (--position-embedding-type, --normalization, --moe-model-type's gate) and
// switches (--swiglu, --group-query-attention, --disable-bias-linear) into the model's
// configuration.
void derive_model(TrainOptions& o) {
  graphs::ModelConfig& m = o.config.model;
  m.activation = o.swiglu ? graphs::Activation::swiglu : graphs::Activation::gelu;
  // Left out, the MLP is Megatron-LM's width for the hidden size (arguments.py): 4 h, or with
  // SwiGLU's two input products 2/3 of it rounded down to a multiple of 64.
  if (!o.gave("--ffn-hidden-size"))
    m.ffn_hidden_size =
        o.swiglu ? static_cast<int>(4.0 * m.hidden_size * 2 / 3 / 64) * 64 : 4 * m.hidden_size;
  if (o.bf16 && o.fp16)
    throw graphs::ConfigError(
        "--bf16 and --fp16 are two precisions: give one (Megatron-LM refuses both, too)");
  m.precision = o.bf16   ? graphs::Precision::bf16
                : o.fp16 ? graphs::Precision::fp16
                         : graphs::Precision::fp32;
  if (o.position_embedding_type == "learned_absolute")
    m.position_embedding = graphs::PositionEmbedding::learned_absolute;
  else if (o.position_embedding_type == "rope")
    m.position_embedding = graphs::PositionEmbedding::rope;
  else if (o.position_embedding_type == "none")
    m.position_embedding = graphs::PositionEmbedding::none;
  else
    throw graphs::ConfigError(fmt::format(
        "--position-embedding-type must be learned_absolute, rope or none (Megatron-LM's "
        "choices), got '{}'",
        o.position_embedding_type));
  if (o.normalization == "LayerNorm")
    m.normalization = graphs::Normalization::layer_norm;
  else if (o.normalization == "RMSNorm")
    m.normalization = graphs::Normalization::rms_norm;
  else
    throw graphs::ConfigError(fmt::format(
        "--normalization must be LayerNorm or RMSNorm (spelt as Megatron-LM spells them), got '{}'",
        o.normalization));
  if (o.cross_entropy_fusion_impl != "native" && o.cross_entropy_fusion_impl != "te")
    throw graphs::ConfigError(fmt::format(
        "--cross-entropy-fusion-impl must be native or te (Megatron-Core's choices), got '{}'",
        o.cross_entropy_fusion_impl));
  m.cross_entropy_fusion = !o.cross_entropy_loss_fusion ? graphs::CrossEntropyFusion::unfused
                           : o.cross_entropy_fusion_impl == "te"
                               ? graphs::CrossEntropyFusion::te
                               : graphs::CrossEntropyFusion::native;
  using graphs::AttentionBackend;
  const std::pair<std::string_view, AttentionBackend> backends[] = {
      {"flash", AttentionBackend::flash},
      {"fused", AttentionBackend::fused},
      {"unfused", AttentionBackend::unfused},
      {"local", AttentionBackend::local},
      {"auto", AttentionBackend::automatic}};
  const auto backend = std::find_if(std::begin(backends), std::end(backends),
                                    [&](const auto& b) { return b.first == o.attention_backend; });
  if (backend == std::end(backends))
    throw graphs::ConfigError(fmt::format(
        "--attention-backend must be flash, fused, unfused, local or auto (Megatron-Core's "
        "AttnBackend), got '{}'",
        o.attention_backend));
  m.attention_backend = backend->second;
  if (o.use_rotary_position_embeddings)
    m.position_embedding = graphs::PositionEmbedding::rope;
  else if (o.no_position_embedding &&
           m.position_embedding == graphs::PositionEmbedding::learned_absolute)
    m.position_embedding = graphs::PositionEmbedding::none;
  if (o.num_query_groups > 0 && !o.group_query_attention)
    throw graphs::ConfigError(fmt::format(
        "--num-query-groups ({}) applies with --group-query-attention, as in Megatron-LM: add "
        "--group-query-attention, or drop --num-query-groups",
        o.num_query_groups));
  if (o.group_query_attention && o.num_query_groups == 0)
    throw graphs::ConfigError(
        "--group-query-attention needs --num-query-groups: the number of key/value heads");
  m.num_query_groups = o.group_query_attention ? o.num_query_groups : 0;
  m.add_bias_linear = !o.disable_bias_linear;
  // MindSpeed's --moe-model-type deepspeed_moe is its layer as a whole: the experts' layout (the
  // plan's) and its gate (the model's).
  m.moe_gate = o.config.plan.moe_model_type == "deepspeed_moe" ? graphs::MoeGate::deepspeed
                                                               : graphs::MoeGate::megatron;
  derive_load_balancing(o.moe_router_load_balancing_type, m);
  graphs::set_moe_layer_freq(m, o.moe_layer_freq);
  // Megatron-Core's post-softmax weights (its default) are the picks' probabilities renormalised
  // over the k picks; pre-softmax leaves them the softmax over all experts.
  if (m.moe_gate == graphs::MoeGate::megatron) m.moe_router_renormalize = !o.moe_router_pre_softmax;
  m.moe_token_drop_by_probability =
      m.moe_gate == graphs::MoeGate::megatron && o.moe_token_drop_policy == "probs";
}

// The recomputation flags' words into the model's configuration, by Megatron-LM's meanings
// (--recompute-activations: --recompute-granularity selective); graphs::validate checks the
// combinations.
void derive_recompute(TrainOptions& o) {
  graphs::Recompute& r = o.config.model.recompute;
  if (o.recompute_activations) {
    if (!o.recompute_granularity.empty() && o.recompute_granularity != "selective")
      throw graphs::ConfigError(fmt::format(
          "--recompute-activations means --recompute-granularity selective (Megatron-LM's "
          "shorthand) and --recompute-granularity is {}: give one of them",
          o.recompute_granularity));
    o.recompute_granularity = "selective";
  }
  r.granularity = o.recompute_granularity == "full"        ? graphs::RecomputeGranularity::full
                  : o.recompute_granularity == "selective" ? graphs::RecomputeGranularity::selective
                                                           : graphs::RecomputeGranularity::none;
  r.method = o.recompute_method == "uniform" ? graphs::RecomputeMethod::uniform
             : o.recompute_method == "block" ? graphs::RecomputeMethod::block
                                             : graphs::RecomputeMethod::none;
  const std::pair<std::string_view, graphs::RecomputeModule> modules[] = {
      {"core_attn", graphs::kRecomputeCoreAttention},
      {"mlp", graphs::kRecomputeMlp},
      {"moe", graphs::kRecomputeMoe},
      {"moe_act", graphs::kRecomputeMoeActivation},
      {"layernorm", graphs::kRecomputeLayerNorm}};
  r.modules = 0;
  for (const std::string& given : o.recompute_modules)
    for (const auto& [name, bit] : modules)
      if (given == name) r.modules |= bit;
}

// --devices into the data-parallel size, and the global batch's default.
void derive_batch(TrainOptions& o) {
  graphs::ParallelPlan& plan = o.config.plan;
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
}

// A whole number as Megatron-LM's int() reads it: digits, single underscores between them
// ("9_765_625"), an optional sign.
std::optional<long long> python_int(const std::string& word) {
  std::size_t at = word.empty() || (word[0] != '-' && word[0] != '+') ? 0 : 1;
  if (at == word.size()) return std::nullopt;
  long long value = 0;
  bool digit_before = false;
  for (; at < word.size(); ++at) {
    const char ch = word[at];
    if (ch == '_' && digit_before && at + 1 < word.size() &&
        std::isdigit(static_cast<unsigned char>(word[at + 1]))) {
      digit_before = false;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(ch))) return std::nullopt;
    if (value > (std::numeric_limits<long long>::max() - (ch - '0')) / 10) return std::nullopt;
    value = value * 10 + (ch - '0');
    digit_before = true;
  }
  return word[0] == '-' ? -value : value;
}

// A run that sets --lr, as every Megatron-LM script does, is that script's: the schedule flags it
// leaves out mean Megatron-LM's defaults (arguments.py: --min-lr 0.0, --lr-warmup-iters 0,
// --lr-decay-style linear). weave's own, which suit its small models, apply when --lr is not given
// either.
void derive_learning_rate(TrainOptions& o) {
  if (!o.gave("--lr")) return;
  graphs::LearningRateSchedule& lr = o.config.learning_rate;
  if (!o.gave("--min-lr")) lr.min_lr = 0;
  if (!o.gave("--lr-warmup-iters")) lr.warmup_iters = 0;
  if (!o.gave("--lr-decay-style")) lr.style = "linear";
}

// --rampup-batch-size's words, and training by samples (--train-samples) beside the iteration
// flags, by Megatron-LM's rules.
void derive_sample_training(TrainOptions& o) {
  graphs::TrainerConfig& c = o.config;
  if (!o.rampup_batch_size.empty()) {
    std::vector<long long> values;
    for (const std::string& word : o.rampup_batch_size) {
      const std::optional<long long> v = python_int(word);
      if (!v || o.rampup_batch_size.size() != 3)
        throw graphs::ConfigError(fmt::format(
            "--rampup-batch-size {} must be three whole numbers, START INCREMENT SAMPLES, like "
            "--rampup-batch-size 32 32 1_000_000",
            fmt::join(o.rampup_batch_size, " ")));
      values.push_back(*v);
    }
    c.rampup = {.start = values[0], .increment = values[1], .samples = values[2]};
  }
  if (!o.gave("--train-samples")) return;
  if (o.gave("--train-iters"))
    throw graphs::ConfigError(fmt::format(
        "--train-samples {} and --train-iters {} are two lengths for one run, which Megatron-LM "
        "refuses: give one of them",
        c.train_samples, c.train_iters));
  // The schedule counts samples: the iteration counts' defaults step aside.
  if (!o.gave("--lr-warmup-iters")) c.learning_rate.warmup_iters = 0;
  if (!o.gave("--lr-decay-iters")) c.learning_rate.decay_iters = 0;
}

}  // namespace

std::string heads_width_text(const graphs::ModelConfig& m) {
  return m.kv_channels > 0 ? fmt::format(" of {}", m.kv_channels) : std::string();
}

std::string moe_text(const graphs::ModelConfig& m) {
  if (m.num_experts == 0) return "dense";
  int moe_layers = 0;
  for (int l = 0; l < m.num_layers; ++l)
    moe_layers += m.is_moe_layer(l) ? 1 : 0;
  const std::string shared =
      m.has_shared_experts()
          ? fmt::format(", shared experts {} wide", m.moe_shared_expert_intermediate_size)
          : "";
  return fmt::format("{} experts top-{}, {} wide{}, in {} of {} layers", m.num_experts,
                     m.moe_router_topk, m.expert_ffn_hidden_size(), shared, moe_layers,
                     m.num_layers);
}

namespace {

// --context-parallel-algo names MindSpeed's algorithm; weave's context parallelism is always the
// ring (its megatron_cp_algo), so the value changes nothing, but MindSpeed's choices and its
// Ampipe rule (arguments.py: with --context-parallel-size > 1 Ampipe asserts megatron_cp_algo)
// stop a MindSpeed run, so they stop this one. Left out, weave's algorithm is the ring;
// MindSpeed's default is ulysses_cp_algo.
void check_context_parallel_algo(const TrainOptions& o) {
  const auto given = o.no_effect_values.find("--context-parallel-algo");
  if (given == o.no_effect_values.end()) return;
  const std::string& algo = given->second;
  constexpr std::string_view kChoices[] = {"ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo",
                                           "adaptive_cp_algo", "hybrid_adaptive_cp_algo"};
  if (std::find(std::begin(kChoices), std::end(kChoices), algo) == std::end(kChoices))
    throw graphs::ConfigError(fmt::format(
        "--context-parallel-algo {} is not one of MindSpeed's algorithms ({}): weave runs the "
        "ring (megatron_cp_algo) whichever is named",
        algo, fmt::join(kChoices, ", ")));
  const graphs::ParallelPlan& p = o.config.plan;
  if (p.ampipe_degree > 1 && p.context_parallel > 1 && algo != "megatron_cp_algo")
    throw graphs::ConfigError(fmt::format(
        "--ampipe-degree {} with --context-parallel-size {} needs --context-parallel-algo "
        "megatron_cp_algo (MindSpeed's rule: Ampipe's two chunks are the ring's load-balanced "
        "halves), got {}: give megatron_cp_algo, or drop the flag (weave's context parallelism "
        "is that ring)",
        p.ampipe_degree, p.context_parallel, algo));
}

// MindSpeed's rules over flags weave accepts without effect (mindspeed/arguments.py): they would
// stop a MindSpeed run, so they stop this one.
void check_mindspeed_flag_rules(const TrainOptions& o) {
  const auto given = [&](std::string_view name) {
    return std::find(o.no_effect.begin(), o.no_effect.end(), name) != o.no_effect.end();
  };
  const graphs::ModelConfig& m = o.config.model;
  if (given("--moe-dynamic-padding") && !m.moe_no_drop)
    throw graphs::ConfigError(
        "--moe-dynamic-padding applies with --moe-no-drop (MindSpeed's rule): add --moe-no-drop "
        "and --moe-model-type deepspeed_moe, or drop it");
  for (const char* flag : {"--use-ascend-mc2", "--use-ascend-coc"})
    if (given(flag) && m.num_experts > 0)
      throw graphs::ConfigError(
          fmt::format("{} is not compatible with MoE models (MindSpeed's rule): drop it", flag));
  check_context_parallel_algo(o);
}

}  // namespace

void derive_config(TrainOptions& o) {
  graphs::TrainerConfig& c = o.config;
  derive_machine(o);
  derive_model(o);
  derive_attention_rates(o);
  derive_recompute(o);
  derive_batch(o);
  derive_sample_training(o);
  apply_sharding_flags(o);  // a DeepSpeed file's optimizer.params.lr is a script's --lr
  derive_learning_rate(o);
  c.timing = o.timing == "model" ? graphs::Timing::virtual_clock : graphs::Timing::wall;
  if (!o.trace_iteration_given) c.trace_iteration = std::min(c.trace_iteration, c.train_iters);
  if (!o.split.empty()) o.valid_fraction = validation_share(o.split);
  graphs::check_flag_rules(c.plan, o.no_effect);
  check_mindspeed_flag_rules(o);
}

std::int64_t modelled_device_memory(const TrainOptions& o, double given_gib) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  if (given_gib > 0) return static_cast<std::int64_t>(given_gib * kGiB);
  if (!o.accelerator.empty()) return devices::Accelerator::load(o.accelerator).memory_bytes;
  return static_cast<std::int64_t>(80 * kGiB);
}

}  // namespace weave::cli
