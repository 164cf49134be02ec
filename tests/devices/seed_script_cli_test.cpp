// Scripts users paste, sizes scaled down, through `weave train` and `weave predict`. The
// sequence-parallelism seed's Megatron-DeepSpeed command line (with a DeepSpeed file written here)
// trains, names the flags and fields without effect once, shards the optimizer state (ZeRO stage
// 1), and ramps the batch as Megatron-LM's rule, worked out here, says; MindSpeed's Ampipe test
// script is known flag by flag.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "run_weave.hpp"

namespace {

using weave::cli_test::weave;

TEST(SeedScript, TrainsAsPastedWithItsRampAndDeepSpeedFile) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("weave-{}-seed", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string ds = (dir / "ds.json").string(), log = (dir / "log.jsonl").string();
  // The seed's ds.json, scaled: 16 = 1 x 8 x 2 replicas.
  std::ofstream(ds) << R"({"train_micro_batch_size_per_gpu": 1, "train_batch_size": 16,
      "gradient_clipping": 1.0, "zero_optimization": {"stage": 1,
      "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000},
      "bf16": {"enabled": false}, "steps_per_print": 2000, "wall_clock_breakdown": false})";
  // The seed's flags, as pasted (--rampup-batch-size 192 16 9_765_625 scaled to 4 2 40).
  const weave::cli_test::Result r = weave(fmt::format(
      "train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
      "--max-position-embeddings 32 --devices 4 --tensor-model-parallel-size 2 "
      "--micro-batch-size 1 --global-batch-size 16 --train-samples 1_00 --lr 6e-4 --min-lr 6e-5 "
      "--lr-decay-style cosine --lr-warmup-samples 20 --clip-grad 1.0 --mock-data "
      "--rampup-batch-size 4 2 40 --deepspeed --deepspeed_config {} --zero-stage 1 "
      "--deepspeed-activation-checkpointing --distributed-backend nccl --sequence-parallel "
      "--log-interval 4 --log-json {}",
      ds, log));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("--deepspeed-activation-checkpointing"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(fmt::format("{}: without effect here: steps_per_print, "
                                   "wall_clock_breakdown, zero_optimization.allgather_bucket_size, "
                                   "zero_optimization.reduce_bucket_size",
                                   ds)),
            std::string::npos)
      << r.out;

  // Megatron-LM's ramp, worked out: (16 - 4) / 2 = 6 increments over 40 samples.
  std::vector<long long> batches;
  long long consumed = 0;
  while (consumed <= 40 && consumed <= 100) {
    batches.push_back(4 + static_cast<long long>(static_cast<double>(consumed) / (40.0 / 6)) * 2);
    consumed += batches.back();
  }
  for (; consumed + 16 <= 100; consumed += 16)
    batches.push_back(16);
  EXPECT_NE(r.out.find(fmt::format("batch ramp-up: global batch 4 (2 micro-batches) growing by 2 "
                                   "to 16 over 40 samples; 100 samples in {} iterations",
                                   batches.size())),
            std::string::npos)
      << r.out;

  std::ifstream in(log);
  std::vector<nlohmann::json> iterations;
  nlohmann::json run;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["type"] == "iteration") iterations.push_back(j);
    if (j["type"] == "run") run = j;
  }
  EXPECT_EQ(run["plan"]["use_distributed_optimizer"], true);  // ZeRO stage 1
  EXPECT_EQ(run["rampup_batch_size"], "4 2 40");
  EXPECT_EQ(run["train_samples"], 100);
  ASSERT_EQ(iterations.size(), batches.size());
  long long samples = 0;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    samples += batches[i];
    EXPECT_EQ(iterations[i]["global_batch_size"], batches[i]) << i;
    EXPECT_EQ(iterations[i]["consumed_samples"], samples) << i;
  }
  EXPECT_LT(iterations.back()["loss"].get<double>(), iterations.front()["loss"].get<double>());
  std::filesystem::remove_all(dir);
  // What it printed, for the record of the run.
  std::printf("%s", r.out.c_str());
}

// MindSpeed's own Ampipe test script (tests_extend/system_tests/feature_tests/deepspeed_moe.sh on
// its core_r0.8.0 branch): GPT_ARGS, MOE_ARGS, RECOMPUTE_ARGS, OUTPUT_ARGS and DATA_ARGS' sizes as
// pasted, --mock-data for its corpus. Every flag is known; at its published sizes weave predict
// models it (bf16, full recomputation, 4 h wide experts); scaled down in sizes only, weave train
// trains it as pasted in bf16 and, without --bf16, in fp32, the two first losses within bf16's
// rounding of each other.
// The losses of the iteration records a run's --log-json file holds, in order.
std::vector<double> iteration_losses(const std::filesystem::path& log) {
  std::vector<double> losses;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["type"] == "iteration") losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

TEST(SeedScript, MindSpeedsAmpipeScriptIsKnownFlagByFlag) {
  const std::string script =
      "--use-legacy-models --tensor-model-parallel-size 2 --context-parallel-size 2 "
      "--context-parallel-algo megatron_cp_algo --use-cp-send-recv-overlap --reuse-fp32-param "
      "--sequence-parallel --use-fused-rotary-pos-emb --use-flash-attn "
      "--use-distributed-optimizer --num-layers 2 --micro-batch-size 1 --global-batch-size 4 "
      "--lr-decay-iters 320000 --lr 5.0e-7 --lr-decay-style cosine --clip-grad 1.0 "
      "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
      "--no-gradient-accumulation-fusion --position-embedding-type rope --no-bias-gelu-fusion "
      "--no-bias-dropout-fusion --attention-dropout 0.0 --hidden-dropout 0.0 "
      "--disable-bias-linear --expert-model-parallel-size 2 --moe-model-type deepspeed_moe "
      "--num-experts 2 --moe-router-topk 2 --enable-token-rearrange-opt --use-pipe-experts "
      "--pipe-experts-multi-stream --pipe-experts-multi-data 4 --ampipe-degree 2 "
      "--ampipe-tp-sp-comm-overlap --moe-no-drop --moe-use-sinkhorn --moe-dynamic-padding "
      "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
      "--vocab-size 50257 --num-workers 4 --split 949,50,1 --log-interval 1 "
      "--save-interval 10000 --eval-interval 10000 --eval-iters 10 --log-throughput "
      "--timing-log-option max --devices 8";
  const weave::cli_test::Result published =
      weave("predict " + script +
            " --hidden-size 12288 --num-attention-heads 96 --seq-length 16384 "
            "--max-position-embeddings 16384 --train-iters 1000 --bf16 --accelerator ascend-910b");
  ASSERT_EQ(published.status, 0) << published.out;
  EXPECT_NE(published.out.find("2 experts top-2, 49152 wide, in 2 of 2 layers, vocabulary 50257 "
                               "(padded 50432), bf16, full recomputation (uniform 1)"),
            std::string::npos)
      << published.out;
  EXPECT_NE(published.out.find("tp 2 + sp, cp 2, ep 2, dp 2, pp 1"), std::string::npos)
      << published.out;

  const std::string scaled = script +
                             " --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                             "--max-position-embeddings 64 --train-iters 2 --mock-data";
  // As pasted, --bf16 included: trained in bf16 (Ampipe's chunks under cp2 through the bf16
  // attention kernel), the same plan as the fp32 run, whose losses it tracks within bf16's
  // rounding over two steps at lr 5e-7 (the updates move the loss by far less than that).
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("weave-{}-ampipe-script", ::getpid());
  std::filesystem::create_directories(dir);
  const std::filesystem::path bf16_log = dir / "bf16.jsonl", fp32_log = dir / "fp32.jsonl";
  const weave::cli_test::Result bf16 =
      weave("train " + scaled + " --bf16 --log-json " + bf16_log.string());
  ASSERT_EQ(bf16.status, 0) << bf16.out;
  EXPECT_NE(bf16.out.find("bf16 mixed precision"), std::string::npos) << bf16.out;
  EXPECT_NE(bf16.out.find("tp 2 + sp, cp 2, ep 2, dp 2, ampipe 2"), std::string::npos) << bf16.out;
  EXPECT_NE(bf16.out.find("iteration      2/2"), std::string::npos) << bf16.out;
  const weave::cli_test::Result fp32 =
      weave("train " + scaled + " --log-json " + fp32_log.string());
  ASSERT_EQ(fp32.status, 0) << fp32.out;
  EXPECT_NE(fp32.out.find("tp 2 + sp, cp 2, ep 2, dp 2, ampipe 2"), std::string::npos) << fp32.out;
  EXPECT_EQ(fp32.out.find("pipe-experts is switched off"), std::string::npos) << fp32.out;
  const std::vector<double> bf16_losses = iteration_losses(bf16_log),
                            fp32_losses = iteration_losses(fp32_log);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(bf16_losses.size(), 2u) << bf16.out;
  ASSERT_EQ(fp32_losses.size(), 2u) << fp32.out;
  // bf16_moe_training_test's bound for a MoE model: sqrt(20) roundings of u = 2^-8 forward,
  // 1.7 % of the loss, and not the fp32 run's bits.
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(bf16_losses[i], fp32_losses[i], std::sqrt(20.0) / 256 * fp32_losses[i]) << i;
    EXPECT_NE(bf16_losses[i], fp32_losses[i]) << i;
  }
  std::printf("bf16 losses %.6f %.6f, fp32 losses %.6f %.6f\n", bf16_losses[0], bf16_losses[1],
              fp32_losses[0], fp32_losses[1]);
}

}  // namespace
