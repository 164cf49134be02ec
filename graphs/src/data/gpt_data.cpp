// GptData: every split of a blend of indexed datasets, as Megatron-LM's
// BlendedMegatronDatasetBuilder assembles GPTDatasets and BlendedDatasets.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <stdexcept>

#include "data/blending_index.hpp"
#include "data/gpt_split_dataset.hpp"
#include "weave/graphs/gpt_dataset.hpp"
#include "weave/graphs/indexed_dataset.hpp"

namespace weave::graphs {

namespace {

constexpr const char* kSplitNames[] = {"train", "valid", "test"};
// Megatron's mid_level_dataset_surplus: each prefix builds this much more than its share.
constexpr double kSurplus = 0.005;

// A split of a blend: one dataset per prefix and, with weights, the blending index.
struct BlendedSplit {
  std::vector<std::optional<data::GptSplitDataset>> parts;
  data::BlendingIndex blending;  // empty for a single prefix without weights
  std::uint64_t size = 0;
};

std::string cache_folder(const GptDataOptions& o, const std::string& prefix) {
  return o.cache_path.empty()
             ? (std::filesystem::path(prefix) / "cache" / "GPTDataset_indices").string()
             : o.cache_path;
}

}  // namespace

struct GptData::Impl {
  std::vector<std::shared_ptr<const IndexedDataset>> datasets;
  std::array<BlendedSplit, 3> splits;
  int from_cache = 0;
  std::string description;

  void build_split(const GptDataOptions& o, const std::array<double, 3>& shares, int s);
};

namespace {

// The documents [begin, end) of split `s` in a prefix of `count` documents: the split's share
// bounds, cumulated, times the count, rounded half to even as Python's round().
std::pair<std::int64_t, std::int64_t> split_documents(const std::array<double, 3>& shares, int s,
                                                      std::size_t count) {
  double start = 0;
  for (int i = 0; i < s; ++i)
    start += shares[static_cast<std::size_t>(i)];
  const double end = start + shares[static_cast<std::size_t>(s)];
  const auto n = static_cast<double>(count);
  return {static_cast<std::int64_t>(std::nearbyint(start * n)),
          static_cast<std::int64_t>(std::nearbyint(end * n))};
}

}  // namespace

void GptData::Impl::build_split(const GptDataOptions& o, const std::array<double, 3>& shares,
                                int s) {
  Impl& d = *this;
  BlendedSplit& split = d.splits[static_cast<std::size_t>(s)];
  const std::uint64_t target = o.num_samples[static_cast<std::size_t>(s)];
  if (target == 0 || !(shares[static_cast<std::size_t>(s)] > 0)) return;
  const bool blended = !o.blend.weights.empty();
  std::vector<double> weights = o.blend.weights;
  std::uint64_t size = 0;
  for (std::size_t p = 0; p < d.datasets.size(); ++p) {
    const auto [begin, end] = split_documents(shares, s, d.datasets[p]->sequences());
    std::uint64_t wanted = target;
    if (blended) {
      const auto share =
          static_cast<std::uint64_t>(std::ceil(static_cast<double>(target) * weights[p]));
      size += share;
      wanted = static_cast<std::uint64_t>(std::ceil(static_cast<double>(share) * (1 + kSurplus)));
    }
    split.parts.emplace_back(
        std::in_place, d.datasets[p],
        data::GptSplitSpec{.name = kSplitNames[s],
                           .begin = begin,
                           .end = end,
                           .num_samples = wanted,
                           .seq_length = o.seq_length,
                           .seed = o.seed,
                           .cache_folder = cache_folder(o, o.blend.prefixes[p])});
    d.from_cache += split.parts.back()->from_cache();
  }
  if (blended) {
    split.blending = data::build_blending_index(weights, static_cast<std::int64_t>(size));
    split.size = size;
  } else {
    split.size = split.parts[0]->size();
  }
}

GptData::GptData(const GptDataOptions& o) : impl_(std::make_unique<Impl>()) {
  if (o.blend.prefixes.empty())
    throw std::invalid_argument("--data-path names no dataset: give a prefix (PREFIX.bin, .idx)");
  const std::array<double, 3> shares = parse_data_split(o.split);
  for (const std::string& prefix : o.blend.prefixes) {
    impl_->datasets.push_back(std::make_shared<const IndexedDataset>(prefix));
  }
  for (int s = 0; s < 3; ++s) {
    try {
      impl_->build_split(o, shares, s);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(fmt::format(
          "--split '{}' gives the {} split {:.3g} % of the documents and that is too little: {}",
          o.split, kSplitNames[s], 100 * shares[static_cast<std::size_t>(s)], e.what()));
    }
  }
  if (size(DataSplit::train) == 0)
    throw std::runtime_error(fmt::format(
        "--data-path and --split '{}' leave the training split without samples: give it data",
        o.split));
  impl_->description =
      fmt::format("{} ({} indexed dataset{}, split {})", fmt::join(o.blend.prefixes, " "),
                  o.blend.prefixes.size(), o.blend.prefixes.size() == 1 ? "" : "s", o.split);
}

GptData::~GptData() = default;
GptData::GptData(GptData&&) noexcept = default;

std::uint64_t GptData::size(DataSplit split) const {
  return impl_->splits[static_cast<std::size_t>(split)].size;
}

void GptData::sample(DataSplit s, std::uint64_t index, std::vector<std::int32_t>& window) const {
  const BlendedSplit& split = impl_->splits[static_cast<std::size_t>(s)];
  if (split.size == 0)
    throw std::out_of_range(
        fmt::format("the {} split has no samples", kSplitNames[static_cast<int>(s)]));
  index %= split.size;
  if (split.blending.dataset.empty()) return split.parts[0]->sample(index, window);
  const auto& part = split.parts[static_cast<std::size_t>(split.blending.dataset[index])];
  part->sample(static_cast<std::uint64_t>(split.blending.sample[index]), window);
}

std::int64_t GptData::max_token() const {
  std::int64_t most = -1;
  for (const auto& d : impl_->datasets)
    most = std::max(most, d->max_token());
  return most;
}

int GptData::indices_from_cache() const {
  return impl_->from_cache;
}
std::string GptData::description() const {
  return impl_->description;
}

}  // namespace weave::graphs
