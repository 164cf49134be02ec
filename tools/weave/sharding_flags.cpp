#include "sharding_flags.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

namespace weave::cli {

namespace {

using nlohmann::json;

[[noreturn]] void refuse(std::string message) {
  throw graphs::ConfigError(std::move(message));
}

// --zero-stage N, or the stage from a DeepSpeed file, onto the distributed optimizer (stage 1),
// the gradients sharded beside it (stage 2) and the parameters too (stage 3).
void apply_zero_stage(TrainOptions& o, int stage, std::string_view source) {
  if (stage < 0 || stage > 3)
    refuse(fmt::format(
        "{} {} is not a ZeRO stage: give 0 (plain data parallelism), 1 (optimizer "
        "state sharded over the data-parallel group), 2 (gradients too) or 3 (parameters "
        "too)",
        source, stage));

  graphs::ParallelPlan& plan = o.config.plan;
  if (stage == 0 && o.gave("--use-distributed-optimizer") && plan.distributed_optimizer)
    refuse(fmt::format(
        "{} 0 (plain data parallelism) and --use-distributed-optimizer (ZeRO stage 1) disagree: "
        "give one of them",
        source));
  plan.distributed_optimizer = stage >= 1;
  plan.shard_gradients = stage >= 2;
  plan.shard_parameters = stage == 3;
}

// Megatron-Core's --use-custom-fsdp with --data-parallel-sharding-strategy.
void apply_fsdp(TrainOptions& o) {
  const std::string& strategy = o.data_parallel_sharding_strategy;
  if (!o.use_custom_fsdp) {
    if (!strategy.empty())
      refuse(fmt::format(
          "--data-parallel-sharding-strategy {} applies to Megatron-Core's fully sharded data "
          "parallelism: add --use-custom-fsdp (--use-megatron-fsdp), or drop it",
          strategy));
    return;
  }
  // Megatron-Core's default while the flag was --use-custom-fsdp (releases 0.12 and 0.13), or
  // the strategy of the --zero-stage given beside it (as --advise names the stage it chose).
  static constexpr const char* kStrategyOfStage[] = {"no_shard", "optim", "optim_grads",
                                                     "optim_grads_params"};
  const std::string chosen = !strategy.empty() ? strategy
                             : o.zero_stage >= 0 && o.zero_stage <= 3
                                 ? kStrategyOfStage[o.zero_stage]
                                 : "no_shard";
  // The strategy's ZeRO stage.
  const int stage = chosen == "optim"                ? 1
                    : chosen == "optim_grads"        ? 2
                    : chosen == "optim_grads_params" ? 3
                                                     : 0;
  if (o.zero_stage >= 0 && o.zero_stage != stage)
    refuse(fmt::format(
        "--zero-stage {} and --data-parallel-sharding-strategy {} disagree on what is sharded: "
        "give one of them",
        o.zero_stage, chosen));
  if (stage >= 1) {
    o.config.plan.distributed_optimizer = true;
    o.config.plan.shard_gradients = stage >= 2;
    o.config.plan.shard_parameters = stage == 3;
  } else if (o.gave("--use-distributed-optimizer") && o.config.plan.distributed_optimizer)
    refuse(
        "--data-parallel-sharding-strategy no_shard (nothing sharded) and "
        "--use-distributed-optimizer (optimizer state sharded) disagree: give optim to shard the "
        "optimizer state, or drop --use-distributed-optimizer");
}

// The DeepSpeed file being read: its name, and the fields read or named so far.
struct Reading {
  std::string file;
  std::vector<std::string> refused, unhonoured;
};

// `value` read from the file as a whole number >= 1, or refused naming the key.
long long positive_integer(const Reading& r, const json& value, std::string_view key) {
  if (!value.is_number_integer() || value.get<long long>() < 1)
    refuse(fmt::format("{}: {} must be a whole number >= 1, got {}", r.file, key, value.dump()));
  return value.get<long long>();
}

double number(const Reading& r, const json& value, std::string_view key) {
  if (!value.is_number() || !std::isfinite(value.get<double>()))
    refuse(fmt::format("{}: {} must be a number, got {}", r.file, key, value.dump()));
  return value.get<double>();
}

// The file's `value` for `flag`: set on the configuration where the command line left the flag
// out, else the same as the command line's or refused naming both.
template <typename T>
void set_or_check(const TrainOptions& o, const Reading& r, std::string_view flag,
                  std::string_view key, T& target, T value) {
  if (!o.gave(flag)) {
    target = value;
    return;
  }
  if (target != value)
    refuse(fmt::format(
        "{} {} and {}'s {} {} disagree: give the same value in both, or leave one of them out",
        flag, target, r.file, key, value));
}

// The half-precision sections. DeepSpeed's engine and Megatron-DeepSpeed's --bf16 must agree for
// a run to train in bf16, so an enabled bf16 section is weave's --bf16 (set where the command line
// left it out); an explicitly disabled one beside --bf16 is a disagreement. The fp16 and amp
// sections carry DeepSpeed's own loss-scaler settings (loss_scale 0 for dynamic,
// initial_scale_power), which are not mapped onto Megatron-LM's flags: refused, naming those.
void read_precision(TrainOptions& o, Reading& r, const json& ds) {
  for (const char* section : {"bf16", "fp16", "amp"}) {
    if (!ds.contains(section)) continue;
    const json& s = ds[section];
    const bool enabled = s.is_object() && s.contains("enabled") && s["enabled"] != false;
    if (std::string_view(section) == "bf16") {
      if (enabled && !o.gave("--bf16")) {
        o.bf16 = true;
        o.config.model.precision = graphs::Precision::bf16;
      } else if (!enabled && o.gave("--bf16") && s.is_object() && s.contains("enabled")) {
        refuse(fmt::format(
            "--bf16 and {}'s bf16.enabled false disagree: give the same value in both, or leave "
            "one of them out",
            r.file));
      }
    } else if (enabled) {
      r.refused.push_back(fmt::format(
          "{}.enabled (DeepSpeed's fp16 loss-scaler settings are not read: give --fp16 with "
          "--loss-scale or --initial-loss-scale on the command line, or use the bf16 section, "
          "or set it false)",
          section));
    }
    if (s.is_object())
      for (const auto& [key, value] : s.items())
        if (key != "enabled") r.unhonoured.push_back(fmt::format("{}.{}", section, key));
  }
}

// The optimizer section: Adam or AdamW (DeepSpeed's Adam is AdamW unless adam_w_mode is false)
// with its parameters onto --lr, --adam-beta1/2, --adam-eps and --weight-decay. Megatron-DeepSpeed
// hands deepspeed.initialize its own optimizer, built from these flags, so DeepSpeed leaves the
// section unused there; weave reads an Adam section's values so that they cannot differ silently
// from the flags, and names another optimizer's section as without effect.
void read_optimizer(TrainOptions& o, Reading& r, const json& section) {
  if (!section.is_object()) refuse(fmt::format("{}: optimizer must be an object", r.file));
  std::string type = section.value("type", std::string());
  std::transform(type.begin(), type.end(), type.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const json params = section.value("params", json::object());
  // Another optimizer than AdamW (Adam with L2 regularisation, or without bias correction).
  if ((type != "adam" && type != "adamw") || !params.is_object() ||
      (type == "adam" && params.value("adam_w_mode", true) != true) ||
      params.value("bias_correction", true) != true) {
    r.unhonoured.push_back("optimizer");
    return;
  }
  graphs::TrainerConfig& c = o.config;
  for (const auto& [key, value] : params.items()) {
    const std::string name = "optimizer.params." + key;
    if (key == "lr") {
      set_or_check(o, r, "--lr", name, c.learning_rate.lr, number(r, value, name));
      // The file's rate is the script's: the schedule's other defaults are Megatron-LM's.
      if (!o.gave("--lr")) o.given.emplace_back("--lr");
    } else if (key == "betas" && value.is_array() && value.size() == 2) {
      set_or_check(o, r, "--adam-beta1", name + "[0]", c.optimizer.adamw.beta1,
                   number(r, value[0], name));
      set_or_check(o, r, "--adam-beta2", name + "[1]", c.optimizer.adamw.beta2,
                   number(r, value[1], name));
    } else if (key == "eps") {
      set_or_check(o, r, "--adam-eps", name, c.optimizer.adamw.eps, number(r, value, name));
    } else if (key == "weight_decay") {
      set_or_check(o, r, "--weight-decay", name, c.optimizer.adamw.weight_decay,
                   number(r, value, name));
    } else if (key != "adam_w_mode" && key != "bias_correction" && key != "torch_adam" &&
               key != "fused") {
      r.unhonoured.push_back(name);
    }
  }
}

// DeepSpeed's batch settings (runtime/config.py: _set_batch_related_parameters completes the
// three from those given, then _batch_assertion checks train = micro x accumulation x world
// size, the world size being the data-parallel size) onto --micro-batch-size and
// --global-batch-size, whose micro-batches per replica are the accumulation steps.
void read_batch(TrainOptions& o, const Reading& r, const json& ds) {
  graphs::ParallelPlan& plan = o.config.plan;
  const long long dp = plan.data_parallel;
  const auto field = [&](const char* key) -> std::optional<long long> {
    if (!ds.contains(key)) return std::nullopt;
    return positive_integer(r, ds[key], key);
  };
  std::optional<long long> train = field("train_batch_size");
  std::optional<long long> micro = field("train_micro_batch_size_per_gpu");
  std::optional<long long> accumulation = field("gradient_accumulation_steps");
  if (!train && !micro && !accumulation) return;
  if (!train && !micro)
    refuse(
        fmt::format("{}: gradient_accumulation_steps needs train_batch_size or "
                    "train_micro_batch_size_per_gpu beside it (DeepSpeed's rule): add one",
                    r.file));
  // DeepSpeed's completion of the missing ones.
  if (train && micro && !accumulation) accumulation = *train / *micro / dp;
  if (train && !micro && accumulation) micro = *train / dp / *accumulation;
  if (!train && micro && accumulation) train = *micro * *accumulation * dp;
  if (train && !micro && !accumulation) accumulation = 1, micro = *train / dp;
  if (!train && micro && !accumulation) accumulation = 1, train = *micro * dp;
  if (*train != *micro * *accumulation * dp)
    refuse(fmt::format(
        "{}: train_batch_size ({}) must equal train_micro_batch_size_per_gpu x "
        "gradient_accumulation_steps x data-parallel size ({} x {} x {} = {}), as DeepSpeed "
        "checks: correct one of them",
        r.file, *train, *micro, *accumulation, dp, *micro * *accumulation * dp));
  if (*micro > std::numeric_limits<int>::max() || *train > std::numeric_limits<int>::max())
    refuse(fmt::format("{}: the batch sizes ({}, {}) are more samples than a step can hold", r.file,
                       *train, *micro));
  set_or_check(o, r, "--micro-batch-size", "train_micro_batch_size_per_gpu", plan.micro_batch_size,
               static_cast<int>(*micro));
  set_or_check(o, r, "--global-batch-size", "train_batch_size", plan.global_batch_size,
               static_cast<int>(*train));
}

// The file's fields that would change what is trained, beyond those read above. (The scheduler
// is not among them: Megatron-DeepSpeed hands deepspeed.initialize its own schedule, which
// DeepSpeed then uses instead.)
constexpr std::string_view kChangesTraining[] = {"sparse_attention", "curriculum_learning",
                                                 "data_efficiency", "compression_training",
                                                 "progressive_layer_drop"};

void read_deepspeed_config(TrainOptions& o) {
  Reading r{.file = o.deepspeed_config};
  std::ifstream in(o.deepspeed_config);
  if (!in)
    refuse(fmt::format("--deepspeed_config: cannot read '{}': give the DeepSpeed JSON file's path",
                       o.deepspeed_config));
  json ds;
  try {
    ds = json::parse(in);
  } catch (const json::exception& e) {
    refuse(fmt::format("--deepspeed_config '{}' is not JSON: {}", o.deepspeed_config, e.what()));
  }
  if (!ds.is_object())
    refuse(fmt::format("--deepspeed_config '{}' must hold a JSON object of DeepSpeed's settings",
                       o.deepspeed_config));
  read_batch(o, r, ds);
  read_precision(o, r, ds);
  for (const auto& [key, value] : ds.items()) {
    if (key == "train_batch_size" || key == "train_micro_batch_size_per_gpu" ||
        key == "gradient_accumulation_steps" || key == "bf16" || key == "fp16" || key == "amp")
      continue;
    if (key == "gradient_clipping") {
      set_or_check(o, r, "--clip-grad", key, o.config.optimizer.clip_grad, number(r, value, key));
    } else if (key == "zero_optimization") {
      if (!value.is_object())
        refuse(fmt::format("{}: zero_optimization must be an object", r.file));
      std::optional<bool> overlap_comm;
      for (const auto& [zkey, zvalue] : value.items()) {
        if (zkey == "overlap_comm" && zvalue.is_boolean()) {
          overlap_comm = zvalue.get<bool>();
          continue;
        }
        if (zkey != "stage") {
          r.unhonoured.push_back("zero_optimization." + zkey);
          continue;
        }
        const int stage = static_cast<int>(number(r, zvalue, "zero_optimization.stage"));
        if (o.zero_stage >= 0 && o.zero_stage != stage)
          refuse(fmt::format(
              "--zero-stage {} and {}'s zero_optimization.stage {} disagree: give the same "
              "stage in both",
              o.zero_stage, r.file, stage));
        apply_zero_stage(o, stage, fmt::format("{}'s zero_optimization.stage", r.file));
      }
      // DeepSpeed's ZeRO optimizer reduces each bucket's gradients during the backward with
      // overlap_comm (stage_1_and_2.py); without ZeRO its engine reduces them after the backward
      // and the field does nothing. weave's stage 1 is its distributed optimizer.
      if (overlap_comm && o.config.plan.distributed_optimizer)
        set_or_check(o, r, "--overlap-grad-reduce", "zero_optimization.overlap_comm",
                     o.config.plan.overlap_grad_reduce, *overlap_comm);
      else if (overlap_comm)
        r.unhonoured.push_back("zero_optimization.overlap_comm");
    } else if (key == "optimizer") {
      read_optimizer(o, r, value);
    } else if (std::find(std::begin(kChangesTraining), std::end(kChangesTraining), key) !=
               std::end(kChangesTraining)) {
      r.refused.push_back(key);
    } else {
      r.unhonoured.push_back(key);
    }
  }
  if (!r.refused.empty())
    refuse(fmt::format(
        "{} asks for what weave cannot train: {}. weave trains the model and the batches its "
        "flags describe: drop these fields",
        r.file, fmt::join(r.refused, ", ")));
  o.deepspeed_unhonoured = std::move(r.unhonoured);
}

}  // namespace

void apply_sharding_flags(TrainOptions& o) {
  if (!o.deepspeed_config.empty() && !o.deepspeed)
    refuse(fmt::format(
        "--deepspeed_config '{}' is read with --deepspeed, as Megatron-DeepSpeed reads it only "
        "then: add --deepspeed, or drop the file",
        o.deepspeed_config));
  if (o.zero_stage >= 0) apply_zero_stage(o, o.zero_stage, "--zero-stage");
  apply_fsdp(o);
  if (!o.deepspeed_config.empty()) read_deepspeed_config(o);
}

}  // namespace weave::cli
