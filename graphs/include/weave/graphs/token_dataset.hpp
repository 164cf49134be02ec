// Training text as byte tokens: a file or a folder of text files, split into training and
// validation parts; or synthetic tokens (--mock-data). The tokens are bytes, so the model's
// vocabulary must hold 256. TrainingData::from turns a dataset into the Trainer's data source.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weave::graphs {

enum class Split { train, valid };

class TokenDataset {
 public:
  // Every regular file under `path` (a file or a folder, read in name order; files ending in
  // .dat or .u8, the fortune indexes, are skipped), one byte a token (vocabulary 256). The last
  // `valid_fraction` of the bytes is the validation split. Throws std::invalid_argument for a
  // seq_length below 1 or a valid_fraction outside [0, 1), std::runtime_error naming the path
  // when nothing can be read or the text is shorter than two sequences.
  static TokenDataset from_text(const std::string& path, int seq_length, double valid_fraction);
  // Synthetic tokens with a learnable pattern: a fixed cycle through 32 tokens (of 256). Both
  // splits are unbounded.
  static TokenDataset mock(int seq_length, std::uint64_t seed);

  // Sample `index` of a split: seq_length + 1 tokens (inputs, then targets shifted by one).
  // Deterministic: the same index gives the same window, so a resumed run sees the data it
  // would have seen. The split must hold more than seq_length tokens (see tokens()): a text's
  // validation split is empty when valid_fraction is 0 or the text too short to spare any.
  void sample(Split split, std::uint64_t index, std::vector<std::int32_t>& out) const;
  std::size_t tokens(Split split) const;
  int seq_length() const { return seq_length_; }
  const std::string& description() const { return description_; }

 private:
  std::vector<std::uint8_t> train_, valid_;
  int seq_length_ = 0;
  std::uint64_t seed_ = 0;
  bool mock_ = false;
  std::vector<std::int32_t> successor_, cycle_start_;  // mock data
  std::string description_;
};

}  // namespace weave::graphs
