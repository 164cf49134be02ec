// One split of one indexed dataset as Megatron-LM's GPTDataset gives it: samples of
// seq_length + 1 tokens through its sample and shuffle indices (gpt_sample_index.hpp), which
// are read from the cache folder or built and saved there (sample_index_cache.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/gpt_sample_index.hpp"
#include "weave/graphs/indexed_dataset.hpp"

namespace weave::graphs::data {

struct GptSplitSpec {
  std::string name;                 // "train", "valid" or "test"
  std::int64_t begin = 0, end = 0;  // its documents (sequences)
  std::uint64_t num_samples = 0;    // requested: the index holds at least these
  int seq_length = 0;
  std::uint32_t seed = 0;
  std::string cache_folder;
};

class GptSplitDataset {
 public:
  GptSplitDataset(std::shared_ptr<const IndexedDataset> data, const GptSplitSpec& spec);

  std::uint64_t size() const { return index_.size(); }
  // Sample `index` (< size()): the shuffled sample's tokens, across its documents.
  void sample(std::uint64_t index, std::vector<std::int32_t>& window) const;
  bool from_cache() const { return from_cache_; }

 private:
  std::shared_ptr<const IndexedDataset> data_;
  GptSampleIndex index_;
  bool from_cache_ = false;
};

}  // namespace weave::graphs::data
