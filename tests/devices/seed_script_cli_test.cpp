// The sequence-parallelism seed's Megatron-DeepSpeed command line, sizes scaled down, through
// `weave train` as a user pastes it (with a DeepSpeed file written here): it trains, names the
// flags and fields without effect once, shards the optimizer state (ZeRO stage 1), and ramps the
// batch as Megatron-LM's rule, worked out here, says.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

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

}  // namespace
