// Batch ramp-up (--rampup-batch-size) as Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator
// grows the batch: each iteration's global batch against the rule worked out here step by step,
// the learning rate counting samples, a step's first loss at the ramp's first batch the same as a
// run at that batch, a checkpoint saved when the batch grows, a run resumed mid-ramp bitwise the
// uninterrupted one, and every bad value refused naming the rule and the fix.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <numbers>
#include <string>
#include <vector>

#include "tiny_model.hpp"
#include "weave/graphs/batch_rampup.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/trainer.hpp"

namespace weave::graphs {
namespace {

// Two data-parallel replicas of one sample a micro-batch: the ramp 2, 4, 6 then 8 samples, each
// 2 samples (one micro-batch per replica) more, over 12 samples; 40 samples trained.
TrainerConfig ramp_config() {
  TrainerConfig c;
  c.model = tiny(0);
  c.model.vocab_size = 256;
  c.plan = {.data_parallel = 2,
            .micro_batch_size = 1,
            .global_batch_size = 8,
            .distributed_optimizer = true};
  c.learning_rate = {.lr = 1e-2, .min_lr = 1e-3, .warmup_iters = 0, .warmup_samples = 6};
  c.train_iters = 0;
  c.train_samples = 40;
  c.rampup = {.start = 2, .increment = 2, .samples = 12};
  c.pin_devices = false;
  return c;
}

TrainingData mock_data(const TrainerConfig& c) {
  return TrainingData::from(TokenDataset::mock(c.model.seq_length, c.model.seed));
}

std::vector<IterationMetrics> train(Trainer& trainer, std::int64_t stop_at = 0) {
  std::vector<IterationMetrics> seen;
  trainer.run({.iteration = [&](const IterationMetrics& m) {
    seen.push_back(m);
    return m.iteration == stop_at ? TrainingControl::stop : TrainingControl::proceed;
  }});
  return seen;
}

// Megatron-LM's rule, written out: (8 - 2) / 2 = 3 increments over 12 samples, one every 4
// samples; past 12 samples consumed the full batch.
std::int64_t megatron_batch(std::int64_t consumed) {
  if (consumed > 12) return 8;
  return 2 + static_cast<std::int64_t>(static_cast<double>(consumed) / 4.0) * 2;
}

// Megatron-LM's schedule over samples: linear warm-up over 6 samples, then cosine to min_lr at
// the 40 samples trained (--lr-decay-samples defaults to --train-samples).
double megatron_rate(std::int64_t samples) {
  if (samples <= 6) return 1e-2 * static_cast<double>(samples) / 6.0;
  const double progress = std::min(1.0, static_cast<double>(samples - 6) / 34.0);
  return 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
}

TEST(BatchRampup, EachIterationTrainsMegatronsBatchAndRate) {
  const TrainerConfig c = ramp_config();
  Trainer trainer(c, mock_data(c));
  // Megatron-LM's iteration count: the ramp's iterations while at most 12 samples are consumed,
  // then whole batches of 8 of what remains.
  std::int64_t consumed = 0, iterations = 0;
  std::vector<std::int64_t> batches;
  while (consumed <= 12) {
    batches.push_back(megatron_batch(consumed));
    consumed += batches.back();
    ++iterations;
  }
  for (; consumed + 8 <= 40; consumed += 8, ++iterations)
    batches.push_back(8);
  EXPECT_EQ(batches, (std::vector<std::int64_t>{2, 2, 4, 6, 8, 8, 8}));
  EXPECT_EQ(trainer.config().train_iters, iterations);

  const std::vector<IterationMetrics> seen = train(trainer);
  ASSERT_EQ(seen.size(), batches.size());
  std::int64_t samples = 0;
  for (std::size_t i = 0; i < seen.size(); ++i) {
    SCOPED_TRACE(i);
    samples += batches[i];
    EXPECT_EQ(seen[i].global_batch_size, batches[i]);
    EXPECT_EQ(seen[i].consumed_samples, static_cast<std::uint64_t>(samples));
    EXPECT_EQ(seen[i].tokens, batches[i] * c.model.seq_length);
    EXPECT_NEAR(seen[i].learning_rate, megatron_rate(samples), 1e-15);
  }
  EXPECT_EQ(trainer.consumed_samples(), static_cast<std::uint64_t>(samples));
  // The last step built is the full batch's: 8 / (1 x 2) = 4 micro-batches a replica.
  EXPECT_NO_THROW(trainer.step().micro_batch(1, 3));
}

// --train-samples reached inside the ramp: Megatron-LM's update_train_iters leaves its loop past
// the samples (batches 2, 2, 4: 8 consumed of 7) and adds (7 - 8) // 8, Python's floor division,
// which takes the overshooting iteration back.
TEST(BatchRampup, TrainSamplesReachedInsideTheRampCountAsMegatronCountsThem) {
  const BatchRampup ramp{.start = 2, .increment = 2, .samples = 12};
  EXPECT_EQ(iterations_for_samples(ramp, 8, 7), 3 + (-1));
  EXPECT_EQ(iterations_for_samples(ramp, 8, 8), 3);
  EXPECT_EQ(iterations_for_samples(ramp, 8, 40), 7);
}

TEST(BatchRampup, TheRampsFirstStepIsARunAtItsBatch) {
  TrainerConfig ramp = ramp_config();
  ramp.learning_rate = {.lr = 1e-2, .min_lr = 1e-2, .style = "constant"};
  TrainerConfig fixed = ramp;
  fixed.rampup = {};
  fixed.plan.global_batch_size = 2;
  fixed.train_samples = 2;
  Trainer a(ramp, mock_data(ramp)), b(fixed, mock_data(fixed));
  const std::vector<IterationMetrics> ramped = train(a, 1), plain = train(b);
  ASSERT_EQ(plain.size(), 1u);
  EXPECT_EQ(ramped[0].loss, plain[0].loss);
  EXPECT_EQ(ramped[0].grad_norm, plain[0].grad_norm);
}

TEST(BatchRampup, AResumeMidRampContinuesBitwise) {
  const TrainerConfig c = ramp_config();
  Trainer whole(c, mock_data(c));
  const std::vector<IterationMetrics> uninterrupted = train(whole);

  const std::string path =
      (std::filesystem::temp_directory_path() / fmt::format("weave-{}-ramp.ckpt", ::getpid()))
          .string();
  TrainerConfig first = c;
  first.save_path = path;
  double evaluated = 0;
  {
    // Stopped after iteration 3 (batches 2, 2, 4: 8 samples), before the batch grows to 6.
    Trainer t(first, mock_data(first));
    train(t, 3);
    EXPECT_EQ(t.consumed_samples(), 8u);
    // Evaluation runs the full batch's step, its state copied from the step trained last.
    evaluated = t.evaluate();
  }
  // The checkpoint loaded by a run at the full batch evaluates the same: the state the ramp's
  // steps hand on is the whole of it.
  TrainerConfig full = c;
  full.rampup = {};
  full.load_path = path;
  EXPECT_EQ(Trainer(full, mock_data(full)).evaluate(), evaluated);
  TrainerConfig fresh = full;
  fresh.load_path.clear();
  EXPECT_NE(Trainer(fresh, mock_data(fresh)).evaluate(), evaluated);
  // Saved when the batch grows, as Megatron-LM saves when the micro-batches change: before
  // iterations 3 (batch 4), 4 (batch 6) and 5 (batch 8), then at the end.
  TrainerConfig saving = c;
  saving.save_path = path + ".saves";
  std::vector<std::int64_t> saves;
  {
    Trainer t(saving, mock_data(saving));
    t.run(
        {.saved = [&](const std::string&, std::int64_t iteration) { saves.push_back(iteration); }});
  }
  std::filesystem::remove(saving.save_path);
  EXPECT_EQ(saves, (std::vector<std::int64_t>{2, 3, 4, 7}));

  TrainerConfig second = c;
  second.load_path = path;
  Trainer resumed(second, mock_data(second));
  EXPECT_EQ(resumed.iteration(), 3);
  EXPECT_EQ(resumed.consumed_samples(), 8u);
  const std::vector<IterationMetrics> rest = train(resumed);
  std::filesystem::remove(path);
  ASSERT_EQ(rest.size() + 3, uninterrupted.size());
  for (std::size_t i = 0; i < rest.size(); ++i) {
    SCOPED_TRACE(rest[i].iteration);
    EXPECT_EQ(rest[i].global_batch_size, uninterrupted[i + 3].global_batch_size);
    EXPECT_EQ(rest[i].loss, uninterrupted[i + 3].loss);
    EXPECT_EQ(rest[i].grad_norm, uninterrupted[i + 3].grad_norm);
  }
}

// validate's refusal of `c`, or "" when it accepts it.
std::string refusal(TrainerConfig c) {
  try {
    validate(c);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return {};
}

TEST(BatchRampup, BadValuesAreRefusedNamingTheRuleAndTheFix) {
  const auto with = [](auto change) {
    TrainerConfig c = ramp_config();
    change(c);
    return refusal(c);
  };
  EXPECT_EQ(refusal(ramp_config()), "");
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {with([](TrainerConfig& c) { c.rampup = {.start = 3, .increment = 5, .samples = 12}; }),
       {"START (3) must be a multiple of --micro-batch-size x data-parallel size (2)",
        "make START and INCREMENT multiples of 2"}},
      {with([](TrainerConfig& c) { c.rampup = {.start = 2, .increment = 4, .samples = 12}; }),
       {"(8 - 2 = 6) must be divisible by --rampup-batch-size INCREMENT (4)",
        "choose an INCREMENT that divides 6"}},
      {with([](TrainerConfig& c) { c.rampup = {.start = 2, .increment = 1, .samples = 12}; }),
       {"INCREMENT (1) must be a multiple of --micro-batch-size x data-parallel size (2)"}},
      {with([](TrainerConfig& c) { c.rampup.start = 8; }),
       {"START (8) must be below --global-batch-size (8)", "drop the flag"}},
      {with([](TrainerConfig& c) { c.rampup.samples = 0; }), {"SAMPLES must be >= 1"}},
      {with([](TrainerConfig& c) { c.rampup.increment = 0; }),
       {"START and INCREMENT must be >= 1"}},
      {with([](TrainerConfig& c) {
         c.train_samples = 0;
         c.train_iters = 10;
         c.learning_rate.warmup_samples = 0;
       }),
       {"needs a run trained by samples", "give --train-samples"}},
      {with([](TrainerConfig& c) { c.learning_rate.warmup_iters = 2; }),
       {"give --lr-warmup-samples and --lr-decay-samples instead"}},
      {with([](TrainerConfig& c) {
         c.rampup = {};
         c.train_samples = 7;
       }),
       {"--train-samples 7 is less than one global batch (8)"}},
  };
  for (const auto& [message, parts] : cases)
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << message << "\n  lacks: " << part;
}

}  // namespace
}  // namespace weave::graphs
