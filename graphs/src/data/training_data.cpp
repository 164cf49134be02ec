#include "weave/graphs/training_data.hpp"

#include <fmt/format.h>

#include <memory>
#include <stdexcept>

namespace weave::graphs {

TrainingData TrainingData::from(TokenDataset dataset) {
  auto shared = std::make_shared<const TokenDataset>(std::move(dataset));
  TrainingData data;
  data.description = shared->description();
  data.train = [shared](std::uint64_t index, std::vector<std::int32_t>& window) {
    shared->sample(Split::train, index, window);
  };
  if (shared->tokens(Split::valid) > static_cast<std::size_t>(shared->seq_length()))
    data.valid = [shared](std::uint64_t index, std::vector<std::int32_t>& window) {
      shared->sample(Split::valid, index, window);
    };
  return data;
}

TrainingData TrainingData::from(GptData dataset) {
  auto shared = std::make_shared<const GptData>(std::move(dataset));
  TrainingData data;
  data.description = shared->description();
  data.train = [shared](std::uint64_t index, std::vector<std::int32_t>& window) {
    shared->sample(DataSplit::train, index, window);
  };
  if (shared->size(DataSplit::valid) > 0)
    data.valid = [shared](std::uint64_t index, std::vector<std::int32_t>& window) {
      shared->sample(DataSplit::valid, index, window);
    };
  return data;
}

void fill_micro_batches(TrainingStep& step, const ModelConfig& model, const ParallelPlan& plan,
                        const SampleSource& samples, std::uint64_t first_sample) {
  const int M = plan.micro_batches(), B = plan.micro_batch_size;
  const std::int64_t S = model.seq_length;
  std::vector<std::int32_t> window;
  for (int dp = 0; dp < plan.data_parallel; ++dp)
    for (int mb = 0; mb < M; ++mb) {
      MicroBatch& batch = step.micro_batch(dp, mb);
      for (int b = 0; b < B; ++b) {
        const std::uint64_t index =
            first_sample + static_cast<std::uint64_t>((dp * M + mb) * B + b);
        samples(index, window);
        if (static_cast<std::int64_t>(window.size()) != S + 1)
          throw std::invalid_argument(fmt::format(
              "sample {} has {} tokens: the model needs --seq-length + 1 = {} (the inputs and "
              "the last target)",
              index, window.size(), S + 1));
        for (std::int64_t s = 0; s <= S; ++s)
          if (window[s] < 0 || window[s] >= model.vocab_size)
            throw std::invalid_argument(fmt::format(
                "token {} of sample {} is {}: outside the model's vocabulary of {} (raise "
                "ModelConfig::vocab_size or map the data's tokens below it)",
                s, index, window[s], model.vocab_size));
        for (std::int64_t s = 0; s < S; ++s) {
          batch.tokens[s * B + b] = window[s];
          batch.targets[s * B + b] = window[s + 1];
        }
      }
    }
}

}  // namespace weave::graphs
