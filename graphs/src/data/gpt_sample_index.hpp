// Megatron-LM's GPT sample construction (megatron/core/datasets/gpt_dataset.py and
// build_sample_idx in helpers.cpp), for one split of one indexed dataset:
//
// - the document index: the split's documents (sequences) repeated for as many epochs as the
//   requested samples need, shuffled with NumPy's RandomState(seed); when the last epoch would
//   give fewer than 80 % of an epoch's samples it is shuffled apart from the others, so its
//   partial use does not skew which documents are seen;
// - the sample index: samples of seq_length + 1 tokens cut from the documents laid end to end
//   in that order, each starting on the last token of the one before (its last target), as
//   (position in the document index, token offset) pairs, partial last sample dropped;
// - the shuffle index: the samples' order, shuffled by the same generator after the documents
//   (the last epoch's samples again apart when its documents were).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace weave::graphs::data {

struct GptSampleIndex {
  std::vector<std::int32_t> documents;  // the document index: sequence numbers
  std::vector<std::int64_t> samples;    // (document-index position, offset) for samples + 1
  std::vector<std::int64_t> shuffle;    // sample order
  int epochs = 0;

  std::size_t size() const { return shuffle.size(); }
};

// The indices for the sequences [begin, end) whose lengths `lengths` holds, to give at least
// `num_samples` samples of `seq_length` + 1 tokens. Throws std::invalid_argument naming the
// split's size when [begin, end) holds fewer than two tokens or seq_length < 1.
GptSampleIndex build_gpt_sample_index(std::span<const std::int32_t> lengths, std::int64_t begin,
                                      std::int64_t end, std::uint64_t num_samples, int seq_length,
                                      std::uint32_t seed);

}  // namespace weave::graphs::data
