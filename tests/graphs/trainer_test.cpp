// The training loop as a library type: a Trainer learns, reports every iteration with the
// schedule's learning rate, stops when told, evaluates, resumes bit for bit, times steps on
// either clock with the same losses, and refuses configurations it cannot run.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/trainer.hpp"
#include "weave/graphs/virtual_replay.hpp"

namespace weave::graphs {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / fmt::format("weave-{}-{}", ::getpid(), name))
      .string();
}

// The tiny model over byte tokens (TokenDataset's vocabulary), on two devices: tensor and
// sequence parallel (dense) or expert and data parallel (MoE).
TrainerConfig tiny_config(int experts, std::int64_t train_iters) {
  TrainerConfig c;
  c.model = tiny(experts);
  c.model.vocab_size = 256;
  c.plan = experts > 0 ? ParallelPlan{.expert_parallel = 2,
                                      .data_parallel = 2,
                                      .micro_batch_size = 2,
                                      .global_batch_size = 8}
                       : ParallelPlan{.tensor_parallel = 2,
                                      .sequence_parallel = true,
                                      .micro_batch_size = 2,
                                      .global_batch_size = 4};
  c.learning_rate = {.lr = 1e-2, .min_lr = 1e-3, .warmup_iters = 2};
  c.train_iters = train_iters;
  c.pin_devices = false;
  return c;
}

TrainingData mock_data(const TrainerConfig& c) {
  return TrainingData::from(TokenDataset::mock(c.model.seq_length, c.model.seed));
}

// Every iteration's metrics of one run().
std::vector<IterationMetrics> train(Trainer& trainer) {
  std::vector<IterationMetrics> seen;
  trainer.run({.iteration = [&](const IterationMetrics& m) {
    seen.push_back(m);
    return TrainingControl::proceed;
  }});
  return seen;
}

std::vector<double> losses(const std::vector<IterationMetrics>& metrics) {
  std::vector<double> out;
  for (const IterationMetrics& m : metrics)
    out.push_back(m.loss);
  return out;
}

TEST(Trainer, TrainsAndTheLossFalls) {
  const TrainerConfig c = tiny_config(0, 30);
  Trainer trainer(c, mock_data(c));
  EXPECT_EQ(trainer.iteration(), 0);
  const TrainingSummary done = trainer.run();
  EXPECT_EQ(done.iterations, 30);
  EXPECT_EQ(trainer.iteration(), 30);
  EXPECT_EQ(trainer.consumed_samples(), 30u * 4);
  EXPECT_LT(done.last_loss, 0.7 * done.first_loss);  // the mock pattern is learnable
  EXPECT_EQ(done.tokens, 30 * 16 * 4);
  EXPECT_GT(done.tokens_per_second, 0);
  EXPECT_GT(done.gflops_per_second, 0);
  EXPECT_FALSE(done.stopped);
  EXPECT_EQ(trainer.run().iterations, 0);  // already at train_iters
}

TEST(Trainer, CallbackSeesEveryIterationWithTheScheduledRate) {
  TrainerConfig c = tiny_config(0, 8);
  c.metrics_interval = 4;
  Trainer trainer(c, mock_data(c));
  EXPECT_EQ(trainer.config().learning_rate.decay_iters, 8);  // 0 meant train_iters
  const std::vector<IterationMetrics> seen = train(trainer);
  ASSERT_EQ(seen.size(), 8u);
  // Linear warm-up over 2 iterations to 1e-2, then cosine down to 1e-3 at iteration 8.
  const LearningRateSchedule schedule{
      .lr = 1e-2, .min_lr = 1e-3, .warmup_iters = 2, .decay_iters = 8};
  for (std::size_t i = 0; i < seen.size(); ++i) {
    const IterationMetrics& m = seen[i];
    const auto it = static_cast<std::int64_t>(i) + 1;
    EXPECT_EQ(m.iteration, it);
    EXPECT_EQ(m.learning_rate, schedule.at(it)) << "iteration " << it;
    EXPECT_EQ(m.tokens, 16 * 4);
    EXPECT_GT(m.seconds, 0);
    EXPECT_TRUE(std::isfinite(m.loss) && m.loss > 0);
    EXPECT_GT(m.grad_norm, 0);
    // Traced (and so measured) on the metrics interval and the trace iteration only.
    EXPECT_EQ(m.exposed_comm_share.has_value(), it % 4 == 0 || it == c.trace_iteration)
        << "iteration " << it;
    EXPECT_FALSE(m.pipeline_bubble.has_value());
    EXPECT_FALSE(m.dropped_picks.has_value());  // dense
  }
  EXPECT_EQ(seen[0].learning_rate, 5e-3);
  EXPECT_EQ(seen[7].learning_rate, 1e-3);
}

TEST(Trainer, CallbackStopsTrainingAndARunContinuesWhereItStopped) {
  const TrainerConfig c = tiny_config(0, 6);
  Trainer trainer(c, mock_data(c));
  std::vector<std::int64_t> iterations;
  const TrainingSummary first = trainer.run({.iteration = [&](const IterationMetrics& m) {
    iterations.push_back(m.iteration);
    return m.iteration == 2 ? TrainingControl::stop : TrainingControl::proceed;
  }});
  EXPECT_TRUE(first.stopped);
  EXPECT_EQ(first.iterations, 2);
  EXPECT_EQ(trainer.iteration(), 2);
  EXPECT_EQ(iterations, (std::vector<std::int64_t>{1, 2}));
  const std::vector<IterationMetrics> rest = train(trainer);
  ASSERT_EQ(rest.size(), 4u);
  EXPECT_EQ(rest.front().iteration, 3);

  // Stopping and going on trains what one uninterrupted run trains.
  Trainer uninterrupted(c, mock_data(c));
  const std::vector<double> all = losses(train(uninterrupted));
  EXPECT_EQ(std::vector<double>(all.begin() + 2, all.end()), losses(rest));
}

TEST(Trainer, EvaluatesAtTheIntervalWithoutChangingTraining) {
  TrainerConfig c = tiny_config(0, 6);
  c.eval_interval = 2;
  c.eval_iters = 3;
  Trainer trainer(c, mock_data(c));
  std::vector<ValidationResult> validations;
  std::vector<double> trained;
  trainer.run({.iteration =
                   [&](const IterationMetrics& m) {
                     trained.push_back(m.loss);
                     return TrainingControl::proceed;
                   },
               .validation = [&](const ValidationResult& v) { validations.push_back(v); }});
  ASSERT_EQ(validations.size(), 3u);
  for (std::size_t i = 0; i < validations.size(); ++i) {
    EXPECT_EQ(validations[i].iteration, 2 * static_cast<std::int64_t>(i + 1));
    EXPECT_TRUE(std::isfinite(validations[i].loss) && validations[i].loss > 0);
  }
  // The model learns the pattern, so what it has not trained on gets easier too.
  EXPECT_LT(validations.back().loss, validations.front().loss);
  // The same batches each time, no update: evaluating again gives the last result exactly.
  EXPECT_EQ(trainer.evaluate(), validations.back().loss);
  EXPECT_EQ(trainer.evaluate(), validations.back().loss);

  // Evaluation neither updates the model nor moves the training data on.
  TrainerConfig no_eval = c;
  no_eval.eval_interval = 0;
  Trainer plain(no_eval, mock_data(no_eval));
  EXPECT_EQ(losses(train(plain)), trained);
}

void expect_resumed_run_gives_bit_identical_losses(const TrainerConfig& c);

TEST(Trainer, ResumedRunGivesBitIdenticalLosses) {
  // MoE over expert and data parallelism: the checkpoint holds every rank's experts, and the
  // resumed run must take the data on from the samples consumed; under ZeRO stage 3 too, whose
  // checkpoint holds the whole values its replicas keep as shards.
  TrainerConfig c = tiny_config(4, 6);
  expect_resumed_run_gives_bit_identical_losses(c);
  c.plan.distributed_optimizer = c.plan.shard_gradients = c.plan.shard_parameters = true;
  SCOPED_TRACE("ZeRO stage 3");
  expect_resumed_run_gives_bit_identical_losses(c);
}

void expect_resumed_run_gives_bit_identical_losses(const TrainerConfig& c) {
  const std::string path = temp_path("trainer-resume.ckpt");
  Trainer uninterrupted(c, mock_data(c));
  const std::vector<double> all = losses(train(uninterrupted));
  ASSERT_EQ(all.size(), 6u);

  // One DeviceSet serves the saving and the resuming Trainer in turn.
  devices::DeviceSet devices(c.plan.devices(), {.pin = false});
  std::vector<std::pair<std::string, std::int64_t>> saves;
  {
    TrainerConfig saving = c;
    saving.save_path = path;
    saving.save_interval = 3;
    Trainer trainer(saving, mock_data(saving), devices);
    trainer.run(
        {.iteration =
             [](const IterationMetrics& m) {
               return m.iteration == 3 ? TrainingControl::stop : TrainingControl::proceed;
             },
         .saved = [&](const std::string& p, std::int64_t it) { saves.emplace_back(p, it); }});
    EXPECT_EQ(trainer.iteration(), 3);
  }
  // The interval save at 3 is the final one too: written once.
  ASSERT_EQ(saves.size(), 1u);
  EXPECT_EQ(saves[0], std::make_pair(path, std::int64_t{3}));

  TrainerConfig resuming = c;
  resuming.load_path = path;
  Trainer trainer(resuming, mock_data(resuming), devices);
  EXPECT_EQ(trainer.iteration(), 3);
  EXPECT_EQ(trainer.consumed_samples(), 3u * 8);
  const std::vector<IterationMetrics> rest = train(trainer);
  ASSERT_EQ(rest.size(), 3u);
  EXPECT_EQ(rest.front().iteration, 4);
  EXPECT_EQ(losses(rest), std::vector<double>(all.begin() + 3, all.end()));
  std::filesystem::remove(path);
}

// Every rank's parameter values, bucket by bucket.
std::vector<std::vector<float>> parameter_values(Trainer& trainer) {
  std::vector<std::vector<float>> out;
  for (int r = 0; r < trainer.config().plan.devices(); ++r)
    for (const GradientBucket& b : trainer.step().shard(r).buckets())
      out.emplace_back(b.values.data(), b.values.data() + b.values.numel());
  return out;
}

// --overlap-param-gather moves the distributed optimizer's gathers from the end of a step to the
// start of the next: the same losses bit for bit, and every replica's parameters gathered
// wherever they are read outside a step: by an evaluation, in the checkpoint, by the caller
// after the run (without the final gathers each replica would hold the other's shard one update
// behind).
TEST(Trainer, OverlapParamGatherTrainsEvaluatesAndSavesBitIdentically) {
  const std::string path = temp_path("trainer-param-gather.ckpt");
  const auto config = [](bool gather_early) {
    TrainerConfig c = tiny_config(0, 4);
    c.plan = {.data_parallel = 2,
              .micro_batch_size = 2,
              .global_batch_size = 8,
              .distributed_optimizer = true};
    c.plan.overlap_grad_reduce = true;
    c.plan.overlap_param_gather = gather_early;
    c.eval_interval = 2;
    c.eval_iters = 1;
    return c;
  };
  std::vector<double> validations[2];
  std::vector<double> trained[2];
  std::vector<std::vector<float>> values[2];
  for (const bool gather_early : {false, true}) {
    TrainerConfig c = config(gather_early);
    if (gather_early) c.save_path = path;
    Trainer trainer(c, mock_data(c));
    trainer.run(
        {.iteration =
             [&](const IterationMetrics& m) {
               trained[gather_early].push_back(m.loss);
               return TrainingControl::proceed;
             },
         .validation =
             [&](const ValidationResult& v) { validations[gather_early].push_back(v.loss); }});
    values[gather_early] = parameter_values(trainer);
  }
  ASSERT_EQ(trained[0].size(), 4u);
  EXPECT_EQ(trained[1], trained[0]);
  ASSERT_EQ(validations[0].size(), 2u);
  EXPECT_EQ(validations[1], validations[0]);
  EXPECT_EQ(values[1], values[0]);
  // The checkpoint saved at the end holds the gathered values.
  TrainerConfig loading = config(true);
  loading.load_path = path;
  Trainer loaded(loading, mock_data(loading));
  EXPECT_EQ(parameter_values(loaded), values[0]);
  std::filesystem::remove(path);
}

TEST(Trainer, VirtualClockGivesModelledTimesAndTheWallClockLosses) {
  const std::string trace = temp_path("trainer-trace.json");
  TrainerConfig c = tiny_config(0, 3);
  Trainer wall(c, mock_data(c));
  const std::vector<IterationMetrics> on_wall = train(wall);

  c.timing = Timing::virtual_clock;
  c.machine = {.device_flops = 1e9, .link = "nvlink4"};
  c.trace_path = trace;
  Trainer modelled(c, mock_data(c));
  const std::vector<IterationMetrics> on_model = train(modelled);
  EXPECT_EQ(losses(on_model), losses(on_wall));
  for (const IterationMetrics& m : on_model) {
    EXPECT_GT(m.seconds, 0);
    // The same dense step costs the same modelled time every iteration, whatever the host did.
    EXPECT_EQ(m.seconds, on_model.front().seconds);
    EXPECT_TRUE(m.exposed_comm_share.has_value());  // the virtual clock always traces
  }
  // Devices ten times faster finish the step sooner: the time is the model's, not the host's.
  c.machine.device_flops = 1e10;
  c.trace_path.clear();
  Trainer faster(c, mock_data(c));
  EXPECT_LT(train(faster).front().seconds, on_model.front().seconds);

  const auto events = nlohmann::json::parse(std::ifstream(trace))["traceEvents"];
  EXPECT_GT(events.size(), 20u);
  std::filesystem::remove(trace);
}

TEST(Trainer, RefusesWhatItCannotRunNamingTheRuleAndTheFix) {
  auto refusal = [](TrainerConfig c, TrainingData data) -> std::string {
    try {
      Trainer trainer(c, std::move(data));
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  TrainerConfig c = tiny_config(0, 0);
  EXPECT_NE(refusal(c, mock_data(c)).find("--train-iters must be >= 1, got 0"), std::string::npos)
      << refusal(c, mock_data(c));

  // Evaluation with a text whose validation split is empty.
  const std::string text = temp_path("trainer-text.txt");
  std::ofstream(text) << std::string(1000, 'a');
  c = tiny_config(0, 2);
  c.eval_interval = 1;
  const std::string no_valid =
      refusal(c, TrainingData::from(TokenDataset::from_text(text, c.model.seq_length, 0.0)));
  EXPECT_NE(no_valid.find("--eval-interval 1 needs validation samples"), std::string::npos)
      << no_valid;
  EXPECT_NE(no_valid.find("or set --eval-interval 0"), std::string::npos) << no_valid;
  std::filesystem::remove(text);

  c = tiny_config(0, 2);
  c.eval_iters = 0;
  EXPECT_NE(refusal(c, mock_data(c)).find("--eval-iters must be >= 1, got 0"), std::string::npos);
  c = tiny_config(0, 2);
  c.machine.link = "nvlink9";
  EXPECT_NE(refusal(c, mock_data(c)).find("unknown link preset 'nvlink9'"), std::string::npos);
  c = tiny_config(0, 2);
  c.plan.tensor_parallel = 3;  // the plan's own rules
  EXPECT_NE(refusal(c, mock_data(c))
                .find("--num-attention-heads (4) must be divisible by --tensor-model-parallel-size "
                      "(3)"),
            std::string::npos);

  c = tiny_config(0, 2);
  devices::DeviceSet three(3, {.pin = false});
  try {
    Trainer trainer(c, mock_data(c), three);
    ADD_FAILURE() << "a DeviceSet of 3 devices for a plan of 2 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("holds 3 devices and the plan needs"), std::string::npos)
        << e.what();
  }
}

// Each rule of a training run refused at least once, naming the flag and the value.
TEST(TrainerConfig, EveryRunRuleIsRefusedWithItsValue) {
  auto refusal = [](auto change) -> std::string {
    TrainerConfig c = tiny_config(0, 2);
    change(c);
    try {
      validate(c);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  EXPECT_EQ(refusal([](TrainerConfig&) {}), "(accepted)");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.learning_rate.warmup_iters = -1; }),
            "--lr-warmup-iters must be >= 0, got -1");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.eval_interval = -1; }),
            "--eval-interval must be >= 0 (0: no evaluation), got -1");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.save_interval = -1; }),
            "--save-interval must be >= 0 (0: save at the end only), got -1");
  // Without --save the interval saves nothing, as in Megatron-LM: named in a warning.
  TrainerConfig unsaved = tiny_config(0, 2);
  unsaved.save_interval = 5;
  unsaved.save_path.clear();
  const std::vector<std::string> warnings = validate(unsaved);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0],
            "--save-interval 5 has no effect without --save, as in Megatron-LM: name the "
            "checkpoint file with --save to save every 5 iterations");
  EXPECT_EQ(unsaved.save_interval, 0);
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.metrics_interval = 0; }),
            "--log-interval must be >= 1, got 0");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.trace_iteration = 0; }),
            "--trace-iteration must be >= 1, got 0");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.optimizer.adamw.weight_decay = -0.5; }),
            "--weight-decay must be >= 0, got -0.5");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.optimizer.clip_grad = -1; }),
            "--clip-grad must be >= 0 (0: no clipping), got -1");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.model.init_method_std = 0; }),
            "--init-method-std must be a finite number > 0, got 0");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.machine.device_flops = 0; }),
            "--device-flops must be a finite number > 0, got 0");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.machine.device_memory_bandwidth = -1; }),
            "--device-memory-bandwidth must be a finite number of bytes/s > 0, got -1");
  EXPECT_EQ(refusal([](TrainerConfig& c) {
              c.learning_rate.lr = std::numeric_limits<double>::infinity();
              c.learning_rate.min_lr = 0;
            }),
            "--lr must be a finite number >= 0, got inf");
  EXPECT_EQ(refusal([](TrainerConfig& c) { c.learning_rate.min_lr = 1; }),
            "--min-lr (1) must be between 0 and --lr (0.01)");
}

TEST(TrainerConfig, DecayRunsOverTheWholeRunWhenNotGiven) {
  TrainerConfig c = tiny_config(0, 7);
  c.learning_rate.decay_iters = 0;
  validate(c);
  EXPECT_EQ(c.learning_rate.decay_iters, 7);
}

TEST(Trainer, RefusesSamplesOutsideTheVocabulary) {
  TrainerConfig c = tiny_config(0, 1);
  c.model.vocab_size = 60;  // the mock data's byte tokens go up to 255
  Trainer trainer(c, mock_data(c));
  try {
    trainer.run();
    ADD_FAILURE() << "tokens beyond the vocabulary were trained on";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("outside the model's vocabulary of 60"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(trainer.iteration(), 0);
}

TEST(Trainer, NonFiniteLossStopsTrainingAfterReportingIt) {
  TrainerConfig c = tiny_config(0, 10);
  c.learning_rate = {.lr = 1e30, .min_lr = 0, .style = "constant"};
  c.optimizer.clip_grad = 0;
  Trainer trainer(c, mock_data(c));
  std::vector<double> seen;
  try {
    trainer.run({.iteration = [&](const IterationMetrics& m) {
      seen.push_back(m.loss);
      return TrainingControl::proceed;
    }});
    ADD_FAILURE() << "a non-finite loss was trained on";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("at iteration {}: lower --lr", seen.size())),
              std::string::npos)
        << e.what();
  }
  ASSERT_FALSE(seen.empty());
  EXPECT_FALSE(std::isfinite(seen.back()));
  EXPECT_LT(seen.size(), 10u);
}

TEST(VirtualReplay, OneStepTakesTheModelledMachinesTime) {
  TrainerConfig c = tiny_config(0, 1);
  c.machine = {.device_flops = 1e9, .link = "nvlink4"};
  const TrainingData data = mock_data(c);
  int inspected = 0;
  const rt::VirtualRunResult run =
      replay_step(c, data.train, true, [&](TrainingStep& step, devices::DeviceSet& set) {
        EXPECT_EQ(set.size(), 2u);
        EXPECT_GT(step.result().loss, 0);  // the kernels ran
        ++inspected;
      });
  EXPECT_EQ(inspected, 1);
  EXPECT_GT(run.makespan, 0);
  EXPECT_FALSE(run.trace.spans().empty());
  // Skipping the kernels changes nothing a dense step's costs depend on.
  EXPECT_EQ(replay_step(c, {}, false).makespan, run.makespan);
  c.machine.device_flops = 1e10;
  EXPECT_LT(replay_step(c, {}, false).makespan, run.makespan);
}

}  // namespace
}  // namespace weave::graphs
