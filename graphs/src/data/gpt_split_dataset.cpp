#include "data/gpt_split_dataset.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <span>
#include <stdexcept>

#include "data/sample_index_cache.hpp"

namespace weave::graphs::data {

namespace {

// What the indices depend on: the files as they are now and every setting.
std::string describe(const IndexedDataset& data, const GptSplitSpec& s) {
  namespace fs = std::filesystem;
  std::string files;
  for (const char* ext : {".idx", ".bin"}) {
    const fs::path path = fs::absolute(data.prefix() + ext);
    files += fmt::format("{} {} bytes, modified {}\n", path.string(), fs::file_size(path),
                         fs::last_write_time(path).time_since_epoch().count());
  }
  return fmt::format("{}split {} of documents {} to {}\nsamples {} of {} + 1 tokens\nseed {}\n",
                     files, s.name, s.begin, s.end, s.num_samples, s.seq_length, s.seed);
}

// Whether every entry of a cached index points inside the split's documents and tokens, so a
// damaged cache file cannot send a read astray.
bool sound(const GptSampleIndex& index, std::span<const std::int32_t> lengths,
           const GptSplitSpec& s) {
  for (const std::int32_t d : index.documents)
    if (d < s.begin || d >= s.end) return false;
  const auto samples = static_cast<std::int64_t>(index.shuffle.size());
  for (std::size_t i = 0; i + 1 < index.samples.size(); i += 2) {
    const std::int64_t position = index.samples[i], offset = index.samples[i + 1];
    if (position < 0 || position >= static_cast<std::int64_t>(index.documents.size())) return false;
    const auto sequence =
        static_cast<std::size_t>(index.documents[static_cast<std::size_t>(position)]);
    if (offset < 0 || offset > std::max(0, lengths[sequence] - 1)) return false;
  }
  for (const std::int64_t j : index.shuffle)
    if (j < 0 || j >= samples) return false;
  return true;
}

}  // namespace

GptSplitDataset::GptSplitDataset(std::shared_ptr<const IndexedDataset> data,
                                 const GptSplitSpec& spec)
    : data_(std::move(data)) {
  const std::vector<std::int32_t> lengths = data_->sequence_lengths();
  auto build = [&] {
    return build_gpt_sample_index(lengths, spec.begin, spec.end, spec.num_samples, spec.seq_length,
                                  spec.seed);
  };
  CachedIndex cached = cached_gpt_sample_index(
      spec.cache_folder, describe(*data_, spec), build,
      [&](const GptSampleIndex& index) { return sound(index, lengths, spec); });
  index_ = std::move(cached.index);
  from_cache_ = cached.from_cache;
}

void GptSplitDataset::sample(std::uint64_t index, std::vector<std::int32_t>& window) const {
  window.clear();
  const auto j = static_cast<std::size_t>(index_.shuffle[static_cast<std::size_t>(index)]);
  const auto first = static_cast<std::size_t>(index_.samples[2 * j]);
  const auto first_offset = static_cast<std::size_t>(index_.samples[2 * j + 1]);
  const auto last = static_cast<std::size_t>(index_.samples[2 * j + 2]);
  const auto last_offset = static_cast<std::size_t>(index_.samples[2 * j + 3]);
  for (std::size_t p = first; p <= last; ++p) {
    const auto sequence = static_cast<std::size_t>(index_.documents[p]);
    const std::size_t from = p == first ? first_offset : 0;
    // The last document gives up to and including the token the next sample starts on.
    const std::size_t to =
        p == last ? last_offset + 1 : static_cast<std::size_t>(data_->sequence_length(sequence));
    data_->read(sequence, from, to - from, window);
  }
}

}  // namespace weave::graphs::data
