// Where `weave train`'s tokens come from: --mock-data, text files (byte tokens, as always), or
// Megatron-LM indexed datasets (one prefix or a weighted blend) read with Megatron's GPT
// sample construction, the vocabulary then the tokenizer's (--tokenizer-type).
#pragma once

#include <memory>

#include "train_options.hpp"
#include "weave/graphs/gpt_dataset.hpp"
#include "weave/graphs/training_data.hpp"

namespace weave::cli {

// Whether --data-path names indexed datasets: several words (a blend) or a prefix whose
// PREFIX.idx exists.
bool names_indexed_data(const TrainOptions& o);

// For indexed data: opens it (building or reading the sample indices for the run's samples)
// and sets the model's vocabulary to the tokenizer's. Throws naming a tokenizer that is not
// weave's, a token id the vocabulary does not hold, a bad blend or split. Text and mock data:
// returns nullptr and changes nothing.
std::shared_ptr<graphs::GptData> open_indexed_data(TrainOptions& o);

// The Trainer's data: `indexed` when given, else mock or text data as the flags say.
graphs::TrainingData training_data(const TrainOptions& o, std::shared_ptr<graphs::GptData> indexed);

}  // namespace weave::cli
