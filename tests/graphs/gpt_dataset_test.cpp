// Megatron's GPT samples from indexed datasets: every sample equals the one an independent
// re-derivation of Megatron's rule gives (documents laid end to end in a NumPy-shuffled order,
// epoch after epoch, cut every seq_length tokens with one token of overlap, then the samples
// NumPy-shuffled), for documents shorter and longer than a sample, one or several epochs and a
// blend of two prefixes; indices come back from the cache and are rebuilt when the data changes.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "weave/graphs/gpt_dataset.hpp"
#include "weave/graphs/indexed_dataset_writer.hpp"

#include "temp_dir.hpp"

namespace fs = std::filesystem;
using namespace weave::graphs;

namespace {

using Documents = std::vector<std::vector<std::int32_t>>;

// 30 documents of 1 to 60 tokens (a sample is 17): token t of document d is d * 100 + t + tag.
Documents corpus(std::uint32_t seed, std::int32_t tag) {
  std::mt19937 rng(seed);
  Documents docs(30);
  for (std::size_t d = 0; d < docs.size(); ++d)
    for (std::uint32_t t = 0, n = 1 + rng() % 60; t < n; ++t)
      docs[d].push_back(static_cast<std::int32_t>(d * 100 + t) + tag);
  return docs;
}

std::string write(const fs::path& dir, const std::string& name, const Documents& docs) {
  const std::string prefix = (dir / name).string();
  IndexedDatasetWriter writer(prefix, TokenType::int32);
  for (const auto& d : docs)
    writer.add_document(d);
  writer.finish();
  return prefix;
}

// NumPy's legacy RandomState(seed).shuffle: MT19937, partners by masked rejection from the end.
struct NumpyShuffle {
  std::mt19937 mt;
  explicit NumpyShuffle(std::uint32_t seed) : mt(seed) {}
  template <typename T>
  void operator()(std::vector<T>& v) {
    for (std::size_t i = v.size() - 1; i > 0; --i) {
      std::uint32_t mask = static_cast<std::uint32_t>(i);
      for (int s = 1; s < 32; s *= 2)
        mask |= mask >> s;
      std::uint32_t j;
      do
        j = mt() & mask;
      while (j > i);
      std::swap(v[i], v[j]);
    }
  }
};

// Megatron's samples of documents [begin, end), re-derived on the flat token stream.
std::vector<std::vector<std::int32_t>> megatron_samples(const Documents& docs, std::size_t begin,
                                                        std::size_t end, std::int64_t wanted, int S,
                                                        std::uint32_t seed) {
  std::int64_t T = 0;
  for (std::size_t d = begin; d < end; ++d)
    T += static_cast<std::int64_t>(docs[d].size());
  std::int64_t epochs = 1;
  while (epochs * T < wanted * S + 1)
    ++epochs;
  const std::int64_t before_last = ((epochs - 1) * T - 1) / S;
  const bool separate =
      epochs > 1 &&
      wanted - before_last < static_cast<std::int64_t>(0.8 * static_cast<double>((T - 1) / S));
  NumpyShuffle shuffle(seed);
  std::vector<std::int32_t> order, last;
  for (std::int64_t e = 0; e < epochs - (separate ? 1 : 0); ++e)
    for (std::size_t d = begin; d < end; ++d)
      order.push_back(static_cast<std::int32_t>(d));
  shuffle(order);
  if (separate) {
    for (std::size_t d = begin; d < end; ++d)
      last.push_back(static_cast<std::int32_t>(d));
    shuffle(last);
    order.insert(order.end(), last.begin(), last.end());
  }
  std::vector<std::int32_t> flat;
  for (const std::int32_t d : order)
    flat.insert(flat.end(), docs[d].begin(), docs[d].end());
  const std::int64_t total = (epochs * T - 1) / S;
  std::vector<std::int64_t> first(static_cast<std::size_t>(separate ? before_last : total)), rest;
  std::iota(first.begin(), first.end(), 0);
  shuffle(first);
  if (separate) {
    for (std::int64_t k = before_last; k < total; ++k)
      rest.push_back(k);
    shuffle(rest);
    first.insert(first.end(), rest.begin(), rest.end());
  }
  std::vector<std::vector<std::int32_t>> samples;
  for (const std::int64_t k : first)
    samples.emplace_back(flat.begin() + k * S, flat.begin() + k * S + S + 1);
  return samples;
}

void expect_samples(const GptData& data, DataSplit split,
                    const std::vector<std::vector<std::int32_t>>& expected) {
  ASSERT_EQ(data.size(split), expected.size());
  std::vector<std::int32_t> window;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    data.sample(split, i, window);
    ASSERT_EQ(window, expected[i]) << "sample " << i;
  }
}

}  // namespace

TEST(GptData, TheDerivationsShuffleIsNumpys) {
  NumpyShuffle shuffle(0);  // numpy.random.RandomState(0).permutation(10)
  std::vector<int> v{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  shuffle(v);
  EXPECT_EQ(v, (std::vector<int>{2, 8, 4, 9, 1, 6, 7, 3, 0, 5}));
}

TEST(GptData, SamplesAreMegatronsOverOneOrSeveralEpochs) {
  TempDir dir("gpt_data");
  const Documents docs = corpus(1, 0);
  const std::string prefix = write(dir.path, "a", docs);
  constexpr int S = 16;
  // One epoch; several with the last one shuffled apart (few samples from it); several whole.
  for (const std::uint64_t wanted : {10ull, 150ull, 171ull}) {
    GptDataOptions o{.blend = {{prefix}, {}},
                     .split = "8,2,0",
                     .seq_length = S,
                     .seed = 1234,
                     .num_samples = {wanted, 7, 0}};
    o.cache_path = (dir.path / fmt::format("cache{}", wanted)).string();
    const GptData data(o);
    SCOPED_TRACE(fmt::format("{} samples", wanted));
    expect_samples(data, DataSplit::train, megatron_samples(docs, 0, 24, wanted, S, 1234));
    expect_samples(data, DataSplit::valid, megatron_samples(docs, 24, 30, 7, S, 1234));
    EXPECT_EQ(data.size(DataSplit::test), 0u);
  }
}

TEST(GptData, ABlendInterleavesItsPrefixesByMegatronsRule) {
  TempDir dir("gpt_data");
  const Documents a = corpus(2, 0), b = corpus(3, 5000);
  const std::string pa = write(dir.path, "a", a), pb = write(dir.path, "b", b);
  constexpr int S = 16;
  constexpr std::uint64_t n = 120;
  GptDataOptions o{.blend = parse_data_blend({"0.3", pa, "0.7", pb}),
                   .split = "1",
                   .seq_length = S,
                   .seed = 7,
                   .num_samples = {n, 0, 0}};
  const GptData data(o);
  const double w[2] = {0.3, 0.7};
  std::vector<std::vector<std::int32_t>> parts[2];
  for (int p = 0; p < 2; ++p) {
    const auto share = static_cast<std::int64_t>(std::ceil(n * w[p]));
    parts[p] = megatron_samples(p == 0 ? a : b, 0, 30,
                                static_cast<std::int64_t>(std::ceil(share * 1.005)), S, 7);
  }
  std::vector<std::vector<std::int32_t>> expected;
  std::int64_t given[2] = {0, 0};
  for (std::uint64_t i = 0; i < 36 + 84; ++i) {  // ceil(0.3 n) + ceil(0.7 n)
    const double k = std::max(1.0, static_cast<double>(i));
    const int p = w[1] * k - given[1] > w[0] * k - given[0] ? 1 : 0;
    expected.push_back(parts[p][static_cast<std::size_t>(given[p]++)]);
  }
  expect_samples(data, DataSplit::train, expected);
}

TEST(GptData, IndicesAreReadFromTheCacheAndRebuiltWhenTheDataChanges) {
  TempDir dir("gpt_data");
  const std::string prefix = write(dir.path, "a", corpus(1, 0));
  GptDataOptions o{
      .blend = {{prefix}, {}}, .split = "8,2,0", .seq_length = 16, .num_samples = {50, 5, 0}};
  std::vector<std::int32_t> first, again;
  {
    const GptData data(o);
    EXPECT_EQ(data.indices_from_cache(), 0);
    data.sample(DataSplit::train, 3, first);
  }
  EXPECT_TRUE(fs::is_directory(fs::path(prefix) / "cache" / "GPTDataset_indices"));
  {
    const GptData data(o);  // a resumed run: the same samples, from the cache
    EXPECT_EQ(data.indices_from_cache(), 2);
    data.sample(DataSplit::train, 3, again);
    EXPECT_EQ(again, first);
  }
  // A damaged cache file (its last shuffle entry beyond the samples) is built again.
  for (const auto& entry :
       fs::directory_iterator(fs::path(prefix) / "cache" / "GPTDataset_indices")) {
    std::fstream f(entry.path(), std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(-8, std::ios::end);
    const std::int64_t beyond = 1 << 30;
    f.write(reinterpret_cast<const char*>(&beyond), 8);
  }
  {
    const GptData data(o);
    EXPECT_EQ(data.indices_from_cache(), 0);
    data.sample(DataSplit::train, 3, again);
    EXPECT_EQ(again, first);
  }
  const Documents changed = corpus(9, 20000);
  write(dir.path, "a", changed);
  const GptData data(o);
  EXPECT_EQ(data.indices_from_cache(), 0);
  expect_samples(data, DataSplit::train, megatron_samples(changed, 0, 24, 50, 16, 1234));
}

TEST(GptData, BadBlendsAndSplitsAreRefusedNamingTheValue) {
  auto message = [](auto f) -> std::string {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(accepted)";
  };
  EXPECT_NE(message([] {
              parse_data_blend({"0.3x", "A", "0.7", "B"});
            }).find("'0.3x'"),
            std::string::npos);
  EXPECT_NE(message([] { parse_data_blend({"A", "B"}); }).find("'A'"), std::string::npos);
  EXPECT_NE(message([] { parse_data_split("0,100,0"); }).find("nothing to train on"),
            std::string::npos);
  EXPECT_NE(message([] { parse_data_split("90,x"); }).find("'90,x'"), std::string::npos);
  TempDir dir("gpt_data");
  const std::string prefix = write(dir.path, "tiny", {{1}, {2}, {3}, {4}});
  GptDataOptions o{
      .blend = {{prefix}, {}}, .split = "1,3", .seq_length = 4, .num_samples = {5, 5, 0}};
  EXPECT_NE(message([&] { GptData{o}; }).find("train split 25 %"), std::string::npos)
      << message([&] { GptData{o}; });
}
