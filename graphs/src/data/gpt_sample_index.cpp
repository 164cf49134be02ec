#include "data/gpt_sample_index.hpp"

#include <fmt/format.h>

#include <numeric>
#include <stdexcept>

#include "data/numpy_random_state.hpp"

namespace weave::graphs::data {

namespace {

// Every sample takes seq_length tokens and one more, its last target, which is the next
// sample's first token (Megatron's add_extra_token_to_sequence).
constexpr std::int64_t kExtra = 1;

// The documents of `epochs` epochs, all shuffled together.
std::vector<std::int32_t> shuffled_epochs(std::int64_t begin, std::int64_t end, int epochs,
                                          NumpyRandomState& rng) {
  std::vector<std::int32_t> order;
  order.reserve(static_cast<std::size_t>((end - begin) * epochs));
  for (int e = 0; e < epochs; ++e)
    for (std::int64_t d = begin; d < end; ++d)
      order.push_back(static_cast<std::int32_t>(d));
  rng.shuffle(std::span<std::int32_t>(order));
  return order;
}

// build_sample_idx: walks the documents, cutting a sample every seq_length tokens.
std::vector<std::int64_t> cut_samples(std::span<const std::int32_t> lengths,
                                      const std::vector<std::int32_t>& documents, int seq_length,
                                      std::int64_t num_samples) {
  std::vector<std::int64_t> samples{0, 0};
  samples.reserve(static_cast<std::size_t>(2 * (num_samples + 1)));
  std::size_t position = 0;  // in `documents`
  std::int64_t offset = 0;   // in that document
  for (std::int64_t s = 1; s <= num_samples; ++s) {
    std::int64_t remaining = seq_length + kExtra;
    while (remaining != 0) {
      const std::int64_t left = lengths[static_cast<std::size_t>(documents[position])] - offset;
      remaining -= left;
      if (remaining <= 0) {
        // The sample ends inside this document; the next starts on its last token.
        offset += remaining + left - kExtra;
        remaining = 0;
      } else if (position + 1 == documents.size()) {
        offset = lengths[static_cast<std::size_t>(documents[position])] - kExtra;
        break;  // the documents are used up (only the last sample can get here)
      } else {
        ++position;
        offset = 0;
      }
    }
    samples.push_back(static_cast<std::int64_t>(position));
    samples.push_back(offset);
  }
  return samples;
}

std::vector<std::int64_t> shuffled_range(std::int64_t from, std::int64_t to,
                                         NumpyRandomState& rng) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(to - from));
  std::iota(order.begin(), order.end(), from);
  rng.shuffle(std::span<std::int64_t>(order));
  return order;
}

}  // namespace

GptSampleIndex build_gpt_sample_index(std::span<const std::int32_t> lengths, std::int64_t begin,
                                      std::int64_t end, std::uint64_t num_samples, int seq_length,
                                      std::uint32_t seed) {
  if (seq_length < 1)
    throw std::invalid_argument(
        fmt::format("--seq-length must be at least 1 (got {})", seq_length));
  const std::int64_t epoch_tokens =
      std::accumulate(lengths.begin() + begin, lengths.begin() + end, std::int64_t{0},
                      [](std::int64_t sum, std::int32_t n) { return sum + n; });
  if (epoch_tokens < 2)
    throw std::invalid_argument(fmt::format(
        "documents {} to {} hold {} tokens: a split needs at least 2 to make a sample (give it "
        "a larger share with --split, or more data)",
        begin, end, epoch_tokens));
  GptSampleIndex index;
  const auto wanted = static_cast<std::int64_t>(num_samples) * seq_length + kExtra;
  index.epochs = 1;
  for (std::int64_t tokens = epoch_tokens; tokens < wanted; tokens += epoch_tokens)
    ++index.epochs;
  bool separate_last = false;
  std::int64_t samples_before_last = 0;
  if (index.epochs > 1) {
    samples_before_last = ((index.epochs - 1) * epoch_tokens - kExtra) / seq_length;
    const std::int64_t from_last = static_cast<std::int64_t>(num_samples) - samples_before_last;
    const std::int64_t per_epoch = (epoch_tokens - kExtra) / seq_length;
    separate_last = from_last < static_cast<std::int64_t>(0.80 * static_cast<double>(per_epoch));
  }
  NumpyRandomState rng(seed);
  if (separate_last) {
    index.documents = shuffled_epochs(begin, end, index.epochs - 1, rng);
    const auto last = shuffled_epochs(begin, end, 1, rng);
    index.documents.insert(index.documents.end(), last.begin(), last.end());
  } else {
    index.documents = shuffled_epochs(begin, end, index.epochs, rng);
  }
  const std::int64_t total = (index.epochs * epoch_tokens - kExtra) / seq_length;
  index.samples = cut_samples(lengths, index.documents, seq_length, total);
  index.shuffle = shuffled_range(0, separate_last ? samples_before_last : total, rng);
  if (separate_last) {
    const auto last = shuffled_range(samples_before_last, total, rng);
    index.shuffle.insert(index.shuffle.end(), last.begin(), last.end());
  }
  return index;
}

}  // namespace weave::graphs::data
