// Where a Trainer's tokens come from: numbered samples of a training and a validation split,
// laid out by the Trainer into every data-parallel rank's micro-batches.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "weave/graphs/gpt_dataset.hpp"
#include "weave/graphs/model_config.hpp"
#include "weave/graphs/parallel_plan.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {

// Fills `window` with sample `index`: seq_length + 1 token ids below the model's vocab_size,
// the inputs followed by the last target (targets are the inputs shifted by one). Must be
// deterministic in `index`: a run resumed from a checkpoint then trains on the samples an
// uninterrupted run would have.
using SampleSource = std::function<void(std::uint64_t index, std::vector<std::int32_t>& window)>;

struct TrainingData {
  SampleSource train;  // required
  SampleSource valid;  // empty: no validation data, so evaluation is refused
  std::string description;

  // A dataset's two splits; the validation source is left empty when that split is too short
  // for one sample. The dataset is moved into the sources (they share it).
  static TrainingData from(TokenDataset dataset);
  // Megatron's GPT samples of indexed datasets: the training and validation splits (the
  // validation source empty when that split has no samples).
  static TrainingData from(GptData data);
};

// Fills every micro-batch of `step` (plan: the one the step was built with) with consecutive
// samples from `first_sample` on: global sample j goes to data-parallel rank j / (M B),
// micro-batch (j / B) % M, column j % B of Megatron's [sequence, batch] layout, for M
// micro-batches of B samples. Throws std::invalid_argument naming the sample when the source
// gives a window of the wrong length or a token outside the vocabulary.
void fill_micro_batches(TrainingStep& step, const ModelConfig& model, const ParallelPlan& plan,
                        const SampleSource& samples, std::uint64_t first_sample);

}  // namespace weave::graphs
