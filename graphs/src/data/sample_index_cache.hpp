// GPT sample indices kept on disk, as Megatron-LM keeps its .npy index files: built once, read
// by later runs. A file is named by a hash of its description (the dataset's files with their
// sizes and modification times, the split's documents, the sample count, sequence length and
// seed) and holds the description itself, so changed data, or any other setting, misses the
// cache and the indices are built again. The files are weave's own (Megatron's are NumPy
// arrays named by an MD5 of its configuration).
#pragma once

#include <functional>
#include <string>

#include "data/gpt_sample_index.hpp"

namespace weave::graphs::data {

struct CachedIndex {
  GptSampleIndex index;
  bool from_cache = false;
  std::string path;  // the file, or "" when the folder cannot be written (then kept in memory)
};

// The index `description` names, read from `folder` when a file there holds it and `sound`
// accepts it (a damaged file is built again), else made by `build` and written there
// (atomically; a folder that cannot be written is not an error).
CachedIndex cached_gpt_sample_index(const std::string& folder, const std::string& description,
                                    const std::function<GptSampleIndex()>& build,
                                    const std::function<bool(const GptSampleIndex&)>& sound);

}  // namespace weave::graphs::data
