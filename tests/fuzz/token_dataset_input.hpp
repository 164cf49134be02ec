// What the token_dataset fuzz target does with one input, shared with the regression tests: a
// file read as byte tokens, split into training and validation parts, and sampled.
//
// Input: one byte, the sequence length (signed); eight bytes, the validation fraction (a double,
// any bit pattern); then the file's bytes. Throws what the loader refuses input with:
// std::invalid_argument for the lengths, std::runtime_error naming the path for the text.
// Aborts when what it read is wrong: a split that loses bytes, a sample that is not
// seq_length + 1 byte tokens.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "scratch_file.hpp"
#include "weave/graphs/token_dataset.hpp"

namespace weave::fuzz {

inline void read_and_sample_text(const std::uint8_t* data, std::size_t size, ScratchFile& file) {
  constexpr std::size_t kHeader = 1 + sizeof(double);
  if (size < kHeader) return;
  const int seq_length = static_cast<std::int8_t>(data[0]);
  double valid_fraction = 0;
  std::memcpy(&valid_fraction, data + 1, sizeof valid_fraction);
  const std::size_t text_size = size - kHeader;

  using graphs::Split;
  const graphs::TokenDataset dataset = graphs::TokenDataset::from_text(
      file.write(data + kHeader, text_size), seq_length, valid_fraction);
  if (dataset.tokens(Split::train) + dataset.tokens(Split::valid) != text_size) std::abort();
  std::vector<std::int32_t> window;
  for (Split split : {Split::train, Split::valid}) {
    // sample() needs a split longer than a sequence (its documented precondition).
    if (dataset.tokens(split) <= static_cast<std::size_t>(seq_length)) continue;
    for (std::uint64_t index : {0ull, 1ull, 12345ull, ~0ull}) {
      dataset.sample(split, index, window);
      if (window.size() != static_cast<std::size_t>(seq_length) + 1) std::abort();
      for (std::int32_t token : window)
        if (token < 0 || token > 255) std::abort();
    }
  }
}

}  // namespace weave::fuzz
