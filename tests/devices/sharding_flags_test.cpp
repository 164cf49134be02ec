// DeepSpeed's and Megatron-Core's sharding flags and the DeepSpeed JSON through `weave train`'s
// parsing: the file's values set what the command line left out, DeepSpeed's batch rule is checked
// as DeepSpeed checks it, every disagreement with the command line is refused naming both, the
// stages and strategies map onto what weave shards: the optimizer state (its distributed
// optimizer), the gradients and the parameters.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "commands.hpp"
#include "train_command_line.hpp"
#include "train_options.hpp"

namespace {

using weave::cli::TrainOptions;

// A DeepSpeed file holding `json`, removed when the test ends.
struct DeepSpeedFile {
  explicit DeepSpeedFile(const std::string& json)
      : path((std::filesystem::temp_directory_path() /
              fmt::format("weave-{}-{}-ds.json", ::getpid(), ++count))
                 .string()) {
    std::ofstream(path) << json;
  }
  ~DeepSpeedFile() { std::filesystem::remove(path); }
  std::string path;
  static inline int count = 0;
};

// `weave train FLAGS` parsed and derived as the program does, without running.
TrainOptions parsed(const std::vector<std::string>& flags) {
  static weave::cli::TrainCommandLine command_line;
  TrainOptions o = command_line.parse(flags);
  weave::cli::derive_config(o);
  return o;
}

// The refusal of FLAGS, or "" when they are taken.
std::string refusal(const std::vector<std::string>& flags) {
  try {
    parsed(flags);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

// Four devices, tensor parallel 2: two data-parallel replicas.
std::vector<std::string> with_file(const DeepSpeedFile& f, std::vector<std::string> more = {}) {
  std::vector<std::string> flags{"--devices", "4",           "--tensor-model-parallel-size",
                                 "2",         "--deepspeed", "--deepspeed_config",
                                 f.path};
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

TEST(DeepSpeedConfig, SetsWhatTheCommandLineLeftOut) {
  const DeepSpeedFile f(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
      "gradient_clipping": 0.5, "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6,
      "weight_decay": 0.05}}, "bf16": {"enabled": false}, "steps_per_print": 10})");
  const TrainOptions o = parsed(with_file(f));
  const weave::graphs::TrainerConfig& c = o.config;
  EXPECT_EQ(c.plan.micro_batch_size, 2);
  EXPECT_EQ(c.plan.global_batch_size, 2 * 3 * 2);  // DeepSpeed's micro x accumulation x dp
  EXPECT_EQ(c.plan.micro_batches(), 3);
  EXPECT_EQ(c.optimizer.clip_grad, 0.5);
  EXPECT_TRUE(c.plan.distributed_optimizer);
  EXPECT_EQ(c.learning_rate.lr, 3e-4);
  // The file's rate is a script's --lr: the schedule flags left out are Megatron-LM's defaults.
  EXPECT_EQ(c.learning_rate.min_lr, 0);
  EXPECT_EQ(c.learning_rate.warmup_iters, 0);
  EXPECT_EQ(c.learning_rate.style, "linear");
  EXPECT_EQ(c.optimizer.adamw.beta1, 0.8);
  EXPECT_EQ(c.optimizer.adamw.beta2, 0.99);
  EXPECT_EQ(c.optimizer.adamw.eps, 1e-6);
  EXPECT_EQ(c.optimizer.adamw.weight_decay, 0.05);
  EXPECT_EQ(o.deepspeed_unhonoured,
            (std::vector<std::string>{"steps_per_print", "zero_optimization.reduce_bucket_size"}));
}

TEST(DeepSpeedConfig, ChecksDeepSpeedsBatchRule) {
  const DeepSpeedFile f(
      R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 3})");
  const std::string e = refusal(with_file(f));
  EXPECT_NE(e.find("train_batch_size (16) must equal train_micro_batch_size_per_gpu x "
                   "gradient_accumulation_steps x data-parallel size (2 x 3 x 2 = 12)"),
            std::string::npos)
      << e;
  // DeepSpeed's completion: train and micro give the accumulation (16 / 2 / 2 = 4).
  const DeepSpeedFile g(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2})");
  EXPECT_EQ(parsed(with_file(g)).config.plan.micro_batches(), 4);
}

TEST(DeepSpeedConfig, RefusesEveryDisagreementNamingBoth) {
  const DeepSpeedFile f(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
      "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
      "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}})");
  EXPECT_EQ(refusal(with_file(f, {"--micro-batch-size", "2", "--global-batch-size", "16",
                                  "--clip-grad", "1.0", "--zero-stage", "1", "--lr", "1e-3"})),
            "");
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--micro-batch-size", "4"},
       "--micro-batch-size 4 and {}'s train_micro_batch_size_per_gpu 2"},
      {{"--global-batch-size", "32"}, "--global-batch-size 32 and {}'s train_batch_size 16"},
      {{"--clip-grad", "0.5"}, "--clip-grad 0.5 and {}'s gradient_clipping 1"},
      {{"--zero-stage", "0"}, "--zero-stage 0 and {}'s zero_optimization.stage 1 disagree"},
      {{"--lr", "2e-3"}, "--lr 0.002 and {}'s optimizer.params.lr 0.001"},
      {{"--adam-beta2", "0.999"}, "--adam-beta2 0.999 and {}'s optimizer.params.betas[1] 0.95"},
  };
  for (const auto& [flags, expected] : cases) {
    const std::string e = refusal(with_file(f, flags));
    EXPECT_NE(e.find(fmt::format(fmt::runtime(expected), f.path)), std::string::npos) << e;
    EXPECT_NE(e.find("give the same"), std::string::npos) << e;
  }
}

// An enabled bf16 section is --bf16: DeepSpeed's engine and the model train in bf16 together.
TEST(DeepSpeedConfig, AnEnabledBf16SectionTrainsInBf16) {
  const DeepSpeedFile on(R"({"bf16": {"enabled": true}})");
  EXPECT_EQ(parsed(with_file(on)).config.model.precision, weave::graphs::Precision::bf16);
  std::vector<std::string> with_flag = with_file(on);
  with_flag.push_back("--bf16");
  EXPECT_EQ(parsed(with_flag).config.model.precision, weave::graphs::Precision::bf16);
  const DeepSpeedFile off(R"({"bf16": {"enabled": false}})");
  EXPECT_EQ(parsed(with_file(off)).config.model.precision, weave::graphs::Precision::fp32);
  std::vector<std::string> disagreeing = with_file(off);
  disagreeing.push_back("--bf16");
  const std::string e = refusal(disagreeing);
  EXPECT_NE(e.find("--bf16 and"), std::string::npos) << e;
  EXPECT_NE(e.find("bf16.enabled false disagree"), std::string::npos) << e;
}

// ZeRO's overlap_comm reduces the gradients during the backward: weave's --overlap-grad-reduce
// under its stage 1; without ZeRO DeepSpeed's engine reduces after the backward and the field is
// named as without effect.
TEST(DeepSpeedConfig, ZeroOverlapCommIsOverlapGradReduce) {
  const DeepSpeedFile stage1(R"({"zero_optimization": {"stage": 1, "overlap_comm": true}})");
  EXPECT_TRUE(parsed(with_file(stage1)).config.plan.overlap_grad_reduce);
  const DeepSpeedFile stage0(R"({"zero_optimization": {"stage": 0, "overlap_comm": true}})");
  const TrainOptions o = parsed(with_file(stage0));
  EXPECT_FALSE(o.config.plan.overlap_grad_reduce);
  EXPECT_NE(std::find(o.deepspeed_unhonoured.begin(), o.deepspeed_unhonoured.end(),
                      "zero_optimization.overlap_comm"),
            o.deepspeed_unhonoured.end());
  const DeepSpeedFile off(R"({"zero_optimization": {"stage": 1, "overlap_comm": false}})");
  const std::string e = refusal(with_file(off, {"--overlap-grad-reduce"}));
  EXPECT_NE(e.find("zero_optimization.overlap_comm"), std::string::npos) << e;
  EXPECT_NE(e.find("disagree"), std::string::npos) << e;
}

TEST(DeepSpeedConfig, RefusesWhatWouldChangeTrainingInOneMessage) {
  const DeepSpeedFile f(R"({"fp16": {"enabled": true}, "curriculum_learning": {"enabled": true},
      "bf16": {"enabled": false}})");
  const std::string e = refusal(with_file(f));
  for (const char* part : {"fp16.enabled (DeepSpeed's fp16 loss-scaler settings are not read",
                           ", curriculum_learning. "})
    EXPECT_NE(e.find(part), std::string::npos) << e << "\n  lacks: " << part;
  // What Megatron-DeepSpeed leaves unused (it hands DeepSpeed its own optimizer and schedule) is
  // named, not refused.
  for (const char* optimizer :
       {R"({"type": "Lamb"})", R"({"type": "Adam", "params": {"adam_w_mode": false}})"}) {
    const DeepSpeedFile unused(
        fmt::format(R"({{"scheduler": {{"type": "WarmupLR"}}, "optimizer": {}}})", optimizer));
    EXPECT_EQ(parsed(with_file(unused)).deepspeed_unhonoured,
              (std::vector<std::string>{"optimizer", "scheduler"}));
  }
  EXPECT_NE(refusal({"--deepspeed_config", f.path}).find("is read with --deepspeed"),
            std::string::npos);
  const DeepSpeedFile broken("{\"train_batch_size\": ");
  EXPECT_NE(refusal(with_file(broken)).find("is not JSON"), std::string::npos);
}

TEST(ShardingFlags, MapEveryStageOntoWhatIsSharded) {
  const std::vector<std::string> dp2{"--devices", "2"};
  const auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), dp2.begin(), dp2.end());
    return more;
  };
  // Optimizer state, gradients, parameters.
  using Sharded = std::tuple<bool, bool, bool>;
  const auto sharded = [&](std::vector<std::string> flags) {
    const weave::graphs::ParallelPlan p = parsed(with(std::move(flags))).config.plan;
    return Sharded{p.distributed_optimizer, p.shard_gradients, p.shard_parameters};
  };
  EXPECT_EQ(sharded({"--zero-stage", "0"}), Sharded(false, false, false));
  EXPECT_EQ(sharded({"--zero-stage", "1"}), Sharded(true, false, false));
  EXPECT_EQ(sharded({"--zero-stage", "2"}), Sharded(true, true, false));
  EXPECT_EQ(sharded({"--zero-stage", "3"}), Sharded(true, true, true));
  EXPECT_EQ(sharded({"--use-megatron-fsdp"}), Sharded(false, false, false));
  EXPECT_EQ(sharded({"--use-custom-fsdp", "--data-parallel-sharding-strategy", "optim"}),
            Sharded(true, false, false));
  EXPECT_EQ(sharded({"--use-custom-fsdp", "--data-parallel-sharding-strategy", "optim_grads"}),
            Sharded(true, true, false));
  EXPECT_EQ(
      sharded({"--use-custom-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"}),
      Sharded(true, true, true));
  // The strategy of the stage given beside --use-custom-fsdp (as --advise names it).
  EXPECT_EQ(sharded({"--use-custom-fsdp", "--zero-stage", "3"}), Sharded(true, true, true));
  const DeepSpeedFile stage2(R"({"zero_optimization": {"stage": 2}})");
  EXPECT_EQ(sharded({"--deepspeed", "--deepspeed_config", stage2.path}),
            Sharded(true, true, false));
  // Stage 3's sizes: weave gathers a layer at a time, two layers in flight, whatever DeepSpeed's
  // prefetch and live-parameter limits say: named as without effect.
  const DeepSpeedFile stage3(
      R"({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7,
          "stage3_max_live_parameters": 1e9}})");
  EXPECT_EQ(sharded({"--deepspeed", "--deepspeed_config", stage3.path}), Sharded(true, true, true));
  EXPECT_EQ(parsed(with({"--deepspeed", "--deepspeed_config", stage3.path})).deepspeed_unhonoured,
            (std::vector<std::string>{"zero_optimization.stage3_max_live_parameters",
                                      "zero_optimization.stage3_prefetch_bucket_size"}));
  EXPECT_NE(refusal(with({"--zero-stage", "4"})).find("is not a ZeRO stage"), std::string::npos);
  EXPECT_NE(refusal(with({"--zero-stage", "2", "--use-custom-fsdp",
                          "--data-parallel-sharding-strategy", "optim"}))
                .find("disagree"),
            std::string::npos);
  EXPECT_NE(refusal(with({"--zero-stage", "0", "--use-distributed-optimizer"})).find("disagree"),
            std::string::npos);
  EXPECT_NE(
      refusal(with({"--data-parallel-sharding-strategy", "optim"})).find("add --use-custom-fsdp"),
      std::string::npos);
  EXPECT_NE(refusal(with({"--zero-stage", "1", "--use-custom-fsdp",
                          "--data-parallel-sharding-strategy", "no_shard"}))
                .find("disagree"),
            std::string::npos);
}

TEST(RampupFlags, ReadMegatronsNumbersAndRules) {
  const weave::graphs::TrainerConfig c =
      parsed({"--devices", "2", "--global-batch-size", "2048", "--train-samples", "20_000_000",
              "--rampup-batch-size", "192", "16", "9_765_625"})
          .config;
  EXPECT_EQ(c.rampup.start, 192);
  EXPECT_EQ(c.rampup.increment, 16);
  EXPECT_EQ(c.rampup.samples, 9'765'625);
  EXPECT_EQ(c.train_samples, 20'000'000);
  EXPECT_NE(refusal({"--rampup-batch-size", "192", "1x", "9"}).find("three whole numbers"),
            std::string::npos);
  EXPECT_NE(refusal({"--train-samples", "100", "--train-iters", "10"}).find("give one of them"),
            std::string::npos);
}

}  // namespace
