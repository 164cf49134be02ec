// Megatron-LM's GPT training data from indexed datasets (indexed_dataset.hpp): `--data-path`
// one prefix or a blend of weighted prefixes ("0.3 A 0.7 B"), `--split` shares of each
// prefix's documents for training, validation and test, and samples of --seq-length + 1 tokens
// built as megatron/core/datasets (gpt_dataset.py, blended_dataset.py and helpers.cpp) build
// them: with the same seed the same samples in the same order.
//
// Each split of each prefix has a document index (its documents, epoch after epoch, shuffled),
// a sample index (samples cut across document boundaries) and a shuffle index, built for the
// samples requested and kept in the cache folder (by default PREFIX/cache/GPTDataset_indices,
// beside the data, as Megatron keeps them), rebuilt when the data or a setting changes. A blend
// asks each prefix for its weight's share of the samples (rounded up, plus Megatron's 0.5 %
// surplus) and interleaves them by Megatron's blending rule.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace weave::graphs {

enum class DataSplit { train = 0, valid = 1, test = 2 };

struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;  // empty for a single prefix given alone
};

// --data-path's words as Megatron pairs them: one prefix, or weight-prefix pairs ("0.3 A 0.7 B"),
// the weights normalised. Megatron's other form, several prefixes without weights (each used
// once over), is refused. Throws std::invalid_argument naming a weight that is not a number
// >= 0, weights summing to 0, or several prefixes without weights.
DataBlend parse_data_blend(const std::vector<std::string>& words);

// Megatron's --split: up to three weights ("949,50,1", "98,2,0"; missing ones 0), normalised.
// Throws std::invalid_argument naming the text when a weight does not parse, is negative or
// all are 0, or the training share is 0.
std::array<double, 3> parse_data_split(const std::string& split);

struct GptDataOptions {
  DataBlend blend;
  std::string split = "969, 30, 1";  // Megatron's default
  int seq_length = 0;
  std::uint32_t seed = 1234;  // --seed
  // Samples to build per split: train_iters x global batch; the evaluations' need; 0 skips.
  std::array<std::uint64_t, 3> num_samples{};
  std::string cache_path;  // --data-cache-path; "" is PREFIX/cache/GPTDataset_indices
};

class GptData {
 public:
  // Opens every prefix and builds (or reads from the cache) every split's indices. Throws
  // std::runtime_error naming a bad dataset (see IndexedDataset) or a split left without
  // samples (naming its share and the fix), std::invalid_argument for a bad option.
  explicit GptData(const GptDataOptions& options);
  ~GptData();
  GptData(GptData&&) noexcept;

  // Samples a split holds (0 when its share is 0 or none were asked for).
  std::uint64_t size(DataSplit split) const;
  // Sample `index` (modulo size(split)): seq_length + 1 token ids.
  void sample(DataSplit split, std::uint64_t index, std::vector<std::int32_t>& window) const;
  // The largest token id any prefix holds, for checking a vocabulary covers the data (a scan
  // of every .bin).
  std::int64_t max_token() const;
  // How many splits' indices came from the cache (the rest were built and saved).
  int indices_from_cache() const;
  std::string description() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weave::graphs
