#include "train_data.hpp"

#include <fmt/format.h>

#include <filesystem>
#include <sstream>
#include <stdexcept>

#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/tokenizer.hpp"

namespace weave::cli {

namespace {

// --data-path's words; one word with spaces (a --config value, a quoted blend) is split.
std::vector<std::string> data_words(const TrainOptions& o) {
  if (o.data_path.size() != 1 || o.data_path[0].find(' ') == std::string::npos) return o.data_path;
  std::vector<std::string> words;
  std::istringstream in(o.data_path[0]);
  for (std::string w; in >> w;)
    words.push_back(w);
  return words;
}

// The samples Megatron asks each split for: train_iters x global batch for training, and for
// validation eval_iters global batches at each evaluation and one at the end. weave evaluates
// no test split.
std::array<std::uint64_t, 3> samples_wanted(const graphs::TrainerConfig& c) {
  const auto batch = static_cast<std::uint64_t>(c.plan.global_batch_size);
  const auto iters = static_cast<std::uint64_t>(c.train_iters);
  const std::uint64_t evaluations =
      c.eval_interval > 0 ? iters / static_cast<std::uint64_t>(c.eval_interval) + 1 : 0;
  return {iters * batch, evaluations * static_cast<std::uint64_t>(c.eval_iters) * batch, 0};
}

}  // namespace

bool names_indexed_data(const TrainOptions& o) {
  if (o.mock_data) return false;
  const std::vector<std::string> words = data_words(o);
  return words.size() > 1 || std::filesystem::exists(words[0] + ".idx");
}

std::shared_ptr<graphs::GptData> open_indexed_data(TrainOptions& o) {
  if (!names_indexed_data(o)) {
    if (!o.mock_data && o.config.model.tokenizer_type != "ByteTokenizer")
      throw std::invalid_argument(fmt::format(
          "--tokenizer-type {} with --data-path '{}', which is text (no '{}.idx'): text is read "
          "as bytes; tokenise it first with weave preprocess and give the prefix it writes",
          o.config.model.tokenizer_type, o.data_path[0], o.data_path[0]));
    return nullptr;
  }
  graphs::TrainerConfig& c = o.config;
  // Checkpoints record the files: absolute, so weave generate finds them from anywhere.
  for (std::string* file : {&c.model.vocab_file, &c.model.merge_file})
    if (!file->empty()) *file = std::filesystem::absolute(*file).string();
  const auto tokenizer = graphs::make_tokenizer({.type = c.model.tokenizer_type,
                                                 .vocab_file = c.model.vocab_file,
                                                 .merge_file = c.model.merge_file});
  graphs::GptDataOptions options{.blend = graphs::parse_data_blend(data_words(o)),
                                 .seq_length = c.model.seq_length,
                                 .seed = static_cast<std::uint32_t>(c.model.seed),
                                 .num_samples = samples_wanted(c),
                                 .cache_path = o.data_cache_path};
  if (!o.split.empty()) options.split = o.split;
  auto data = std::make_shared<graphs::GptData>(options);
  const std::int64_t most = data->max_token();
  if (most >= tokenizer->vocab_size())
    throw std::runtime_error(fmt::format(
        "--data-path holds token id {}, outside {}'s vocabulary of {}: give the --tokenizer-type "
        "(and its files) the data was preprocessed with",
        most, tokenizer->type(), tokenizer->vocab_size()));
  c.model.vocab_size = tokenizer->vocab_size();
  return data;
}

graphs::TrainingData training_data(const TrainOptions& o,
                                   std::shared_ptr<graphs::GptData> indexed) {
  const graphs::TrainerConfig& c = o.config;
  if (indexed) return graphs::TrainingData::from(std::move(*indexed));
  return graphs::TrainingData::from(
      o.mock_data
          ? graphs::TokenDataset::mock(c.model.seq_length, c.model.seed)
          : graphs::TokenDataset::from_text(o.data_path[0], c.model.seq_length, o.valid_fraction));
}

}  // namespace weave::cli
