// Vocab-parallel cross-entropy as Megatron runs it: each tensor-parallel device holds a slice
// of the vocabulary, and the two reductions are all-reduces between graph tasks.
#include <gtest/gtest.h>

#include <random>

#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/ops/cross_entropy.hpp"

namespace weave::ops {
namespace {

TEST(VocabParallelCrossEntropy, FourDevicesThroughAllReducesEqualTheWholeVocabulary) {
  constexpr int kRanks = 4, kLocal = 25, kTokens = 9;
  std::mt19937 gen(3);
  std::normal_distribution<float> dist(0.f, 3.f);
  const Tensor logits = Tensor::empty({kTokens, kRanks * kLocal});
  for (std::int64_t i = 0; i < logits.numel(); ++i)
    logits.data()[i] = dist(gen);
  const std::vector<std::int32_t> targets{0, 99, 24, 25, -100, 50, 74, 75, 13};
  const CrossEntropyOptions options{.label_smoothing = 0.05};
  const Tensor lse = Tensor::empty({kTokens});
  const double whole = cross_entropy_forward<float>(logits, targets, options, lse);
  const Tensor dwhole = Tensor::empty(logits.shape());
  cross_entropy_backward<float>(logits, targets, {}, lse, options, 1.0, dwhole);

  devices::DeviceSet set(kRanks, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  const devices::ProcessGroup tp("tp", {0, 1, 2, 3});
  struct Rank {
    Tensor logits, row_max, partials, lse, dlogits;
    double loss = 0;
  };
  std::vector<Rank> ranks(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    auto& dev = set[static_cast<rt::DeviceId>(r)];
    ranks[r].logits = logits.slice(1, r * kLocal, kLocal).clone();
    ranks[r].row_max = Tensor::empty({kTokens}, dev, rt::MemoryCategory::activations);
    ranks[r].partials =
        Tensor::empty({kTokens, kCrossEntropyPartials}, dev, rt::MemoryCategory::activations);
    ranks[r].lse = Tensor::empty({kTokens}, dev, rt::MemoryCategory::activations);
    ranks[r].dlogits = Tensor::empty({kTokens, kLocal}, dev, rt::MemoryCategory::gradients);
  }
  rt::GraphBuilder b;
  std::vector<std::span<float>> maxima, sums;
  std::vector<rt::TaskId> first, second, last;
  for (int r = 0; r < kRanks; ++r) {
    Rank& k = ranks[r];
    const auto d = static_cast<rt::DeviceId>(r);
    const VocabShard shard{r * kLocal, kRanks * kLocal};
    maxima.emplace_back(k.row_max.data(), kTokens);
    sums.emplace_back(k.partials.data(), kTokens * kCrossEntropyPartials);
    first.push_back(b.add({.device = d, .name = "row_max"},
                          [&k](rt::TaskContext&) { cross_entropy_row_max(k.logits, k.row_max); }));
    second.push_back(
        b.add({.device = d, .name = "partials"}, [&k, &targets, shard](rt::TaskContext&) {
          cross_entropy_partial_sums<float>(k.logits, targets, shard, k.row_max, k.partials);
        }));
    last.push_back(b.add({.device = d, .name = "loss"}, [&, shard](rt::TaskContext&) {
      k.loss = cross_entropy_loss<float>(k.row_max, k.partials, targets, kRanks * kLocal, options,
                                         k.lse, Tensor{});
      cross_entropy_backward<float>(k.logits, targets, shard, k.lse, options, 1.0, k.dlogits);
    }));
  }
  const auto max_tasks = comm.all_reduce(b, tp, maxima, devices::ReduceOp::max);
  const auto sum_tasks = comm.all_reduce(b, tp, sums, devices::ReduceOp::sum);
  for (int r = 0; r < kRanks; ++r) {
    b.precede(first[r], max_tasks[r]);
    b.precede(max_tasks[r], second[r]);
    b.precede(second[r], sum_tasks[r]);
    b.precede(sum_tasks[r], last[r]);
  }
  set.executor().run(b.build());
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_NEAR(ranks[r].loss, whole, 1e-5 * whole) << "rank " << r;
    EXPECT_EQ(ranks[r].loss, ranks[0].loss);  // the same reduced statistics on every rank
    for (int t = 0; t < kTokens; ++t)
      for (int j = 0; j < kLocal; ++j)
        ASSERT_NEAR(ranks[r].dlogits(t, j), dwhole(t, r * kLocal + j), 1e-6) << r << "," << t;
  }
}

// A 16-bit run writes the logits' gradient over its fp32 logits (the only fp32 copy it keeps):
// in place, on a vocabulary shard with label smoothing and an ignored row, the gradient is
// bitwise the one written beside the logits.
TEST(VocabParallelCrossEntropy, TheGradientWrittenOverTheLogitsIsTheOneWrittenBeside) {
  constexpr int kLocal = 31, kTokens = 7;
  std::mt19937 gen(5);
  std::normal_distribution<float> dist(0.f, 2.f);
  const Tensor logits = Tensor::empty({kTokens, kLocal});
  for (std::int64_t i = 0; i < logits.numel(); ++i)
    logits.data()[i] = dist(gen);
  const std::vector<std::int32_t> targets{3, 40, -100, 30, 31, 0, 61};
  const CrossEntropyOptions options{.label_smoothing = 0.1};
  const VocabShard shard{31, 62};
  const Tensor lse = Tensor::empty({kTokens});
  for (int r = 0; r < kTokens; ++r)  // any finite log-sum-exp: the gradient reads it only
    lse.data()[r] = 1.5f + 0.25f * static_cast<float>(r);
  const Tensor beside = Tensor::empty(logits.shape());
  cross_entropy_backward<float>(logits, targets, shard, lse, options, 3.0, beside);
  const Tensor over = logits.clone();
  cross_entropy_backward<float>(over, targets, shard, lse, options, 3.0, over);
  for (std::int64_t i = 0; i < logits.numel(); ++i)
    ASSERT_EQ(over.data()[i], beside.data()[i]) << i;
}

}  // namespace
}  // namespace weave::ops
