// Megatron-Core's --moe-router-load-balancing-type seq_aux_loss and sinkhorn in the router: the
// sequence-wise loss against each sequence's Switch loss worked out here, the Sinkhorn routing's
// picks against a Sinkhorn balancing written here from its formula, and both gradients against
// finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "gradient_check.hpp"
#include "router_gradient.hpp"
#include "weave/ops/router.hpp"

namespace weave::ops {
namespace {

using testing::dot;
using testing::expect_gradient;
using testing::expect_router_gradient;
using testing::random_tensor;
using testing::TensorD;

std::vector<double> softmax_row(const TensorD& x, std::int64_t i) {
  const std::int64_t e = x.dim(1);
  std::vector<double> p(static_cast<std::size_t>(e));
  double sum = 0;
  for (std::int64_t j = 0; j < e; ++j)
    sum += (p[j] = std::exp(x(i, j)));
  for (double& v : p)
    v /= sum;
  return p;
}

// The k largest entries of `key`, largest first, ties to the lower index.
std::vector<int> top(const std::vector<double>& key, int k) {
  std::vector<int> order(key.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
  order.resize(static_cast<std::size_t>(k));
  return order;
}

TEST(RouterBalancing, SeqAuxLossIsTheMeanOfEachSequencesSwitchLoss) {
  // 5 positions of 3 sequences stored [s, B]: token i is position i / 3 of sequence i % 3.
  const std::int64_t S = 5, B = 3, T = S * B, E = 4;
  const int k = 2;
  const double coeff = 0.1;
  std::mt19937 gen(3);
  const TensorD logits = random_tensor({T, E}, gen, -2, 2);
  const RouterOptions seq{.top_k = k, .aux_loss_coeff = coeff, .sequences = static_cast<int>(B)};
  const TensorD probs = TensorD::empty({T, E}), w = TensorD::empty({T, k});
  std::vector<std::int32_t> index(static_cast<std::size_t>(T * k));
  const RouterStatistics stats = router_forward(seq, logits, probs, std::span(index), w);
  // Each sequence's loss E / (k S^2) sum_e count_e P_e over its own S tokens, then the mean.
  double expected = 0, whole = 0;
  std::vector<double> all_count(E, 0), all_prob(E, 0);
  for (std::int64_t b = 0; b < B; ++b) {
    std::vector<double> count(E, 0), prob(E, 0);
    for (std::int64_t s = 0; s < S; ++s) {
      const std::vector<double> p = softmax_row(logits, s * B + b);
      for (int e : top(p, k))
        count[e] += 1;
      for (std::int64_t e = 0; e < E; ++e)
        prob[e] += p[e];
    }
    double sum = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      sum += count[e] * prob[e];
      all_count[e] += count[e];
      all_prob[e] += prob[e];
    }
    expected += coeff * E * sum / (k * S * S) / B;
  }
  for (std::int64_t e = 0; e < E; ++e)
    whole += coeff * E * all_count[e] * all_prob[e] / (k * T * T);
  EXPECT_NEAR(aux_loss(seq, stats), expected, 1e-12);
  // Not the batch's loss: the sequences' loads differ.
  RouterOptions batch = seq;
  batch.sequences = 0;
  const RouterStatistics batch_stats = router_forward(batch, logits, probs, std::span(index), w);
  EXPECT_NEAR(aux_loss(batch, batch_stats), whole, 1e-12);
  EXPECT_GT(std::abs(expected - whole), 1e-3 * whole);
  // Rows of whole positions routed apart add up to the same statistics.
  RouterStatistics parts;
  for (const std::int64_t first : {std::int64_t{0}, 2 * B}) {
    const std::int64_t rows = first == 0 ? 2 * B : T - 2 * B;
    const TensorD part = TensorD::empty({rows, E});
    std::copy_n(logits.row(first), rows * E, part.data());
    std::vector<std::int32_t> part_index(static_cast<std::size_t>(rows * k));
    parts += router_forward(seq, part, TensorD::empty({rows, E}), std::span(part_index),
                            TensorD::empty({rows, k}));
  }
  EXPECT_NEAR(aux_loss(seq, parts), expected, 1e-12);
  // A row count that is not whole positions of the sequences is refused.
  EXPECT_THROW(router_forward(seq, TensorD::empty({4, E}), TensorD::empty({4, E}),
                              std::span(index).first(8), TensorD::empty({4, k})),
               std::invalid_argument);
}

TEST(RouterBalancing, SeqAuxLossGradientMatchesFiniteDifferences) {
  for (const RouterScore score :
       {RouterScore::softmax, RouterScore::sigmoid, RouterScore::sqrtsoftplus}) {
    std::mt19937 gen(11);
    const std::int64_t T = 8, E = 5;
    const RouterOptions opt{
        .top_k = 2, .score = score, .aux_loss_coeff = 0.3, .z_loss_coeff = 0.02, .sequences = 2};
    expect_router_gradient(score == RouterScore::softmax   ? "softmax"
                           : score == RouterScore::sigmoid ? "sigmoid"
                                                           : "sqrtsoftplus",
                           opt, T, E, gen);
  }
}

// Sinkhorn's balancing of exp(logits) as S-BASE defines it: alternate the token scales
// d0 = 1/T / (C d1 + eps) and the expert scales d1 = 1/E / (C^T d0 + eps) from d1 = 1 until d1's
// mean absolute change is at most 1e-4; the balanced matrix is d0 C d1.
std::vector<std::vector<double>> balanced(const TensorD& logits) {
  const std::int64_t T = logits.dim(0), E = logits.dim(1);
  std::vector<double> d0(T, 1), d1(E, 1);
  for (double change = 1; change > 1e-4;) {
    for (std::int64_t t = 0; t < T; ++t) {
      double s = 0;
      for (std::int64_t e = 0; e < E; ++e)
        s += d1[e] * std::exp(logits(t, e));
      d0[t] = 1.0 / T / (s + 1e-8);
    }
    change = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (std::int64_t t = 0; t < T; ++t)
        s += d0[t] * std::exp(logits(t, e));
      const double next = 1.0 / E / (s + 1e-8);
      change += std::abs(next - d1[e]) / E;
      d1[e] = next;
    }
  }
  std::vector<std::vector<double>> out(T, std::vector<double>(E));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e)
      out[t][e] = d0[t] * std::exp(logits(t, e)) * d1[e];
  return out;
}

TEST(RouterBalancing, SinkhornPicksTheBalancedTopKAndWeighsByTheScores) {
  // Expert 0 is every token's favourite: plain top-k would send all of them there.
  const std::int64_t T = 8, E = 4;
  std::mt19937 gen(5);
  TensorD logits = random_tensor({T, E}, gen, -1, 1);
  for (std::int64_t t = 0; t < T; ++t)
    logits(t, 0) += 2.0;
  const std::vector<std::vector<double>> c = balanced(logits);
  for (const int k : {1, 2}) {
    const RouterOptions o{.top_k = k,
                          .score = k == 1 ? RouterScore::sigmoid : RouterScore::softmax,
                          .renormalize = false,
                          .sinkhorn = true};
    const TensorD probs = TensorD::empty({T, E}), w = TensorD::empty({T, k});
    std::vector<std::int32_t> index(static_cast<std::size_t>(T * k));
    router_forward(o, logits, probs, std::span(index), w);
    int differ = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      const std::vector<int> picks = top(c[t], k);
      const std::vector<double> p = softmax_row(logits, t);
      differ += picks != top(p, k);
      for (int s = 0; s < k; ++s) {
        ASSERT_EQ(index[t * k + s], picks[s]) << "token " << t << " pick " << s;
        const double score = k == 1 ? 1 / (1 + std::exp(-logits(t, picks[s]))) : p[picks[s]];
        EXPECT_NEAR(w(t, s), score, 1e-12);
      }
    }
    EXPECT_GT(differ, 0) << "top-" << k << ": the balancing changed no token's picks";
  }
  // Its gradient: through the weights' scores (and the z-loss) only, the picks held.
  const RouterOptions o{.top_k = 2, .renormalize = false, .z_loss_coeff = 0.05, .sinkhorn = true};
  const TensorD r = random_tensor({T, 2}, gen);
  const TensorD probs = TensorD::empty({T, E}), w = TensorD::empty({T, 2});
  std::vector<std::int32_t> index(static_cast<std::size_t>(T * 2));
  RouterStatistics stats;
  auto loss = [&] {
    stats = router_forward(o, logits, probs, std::span(index), w);
    return dot(w, r) + z_loss(o, stats);
  };
  loss();
  const TensorD dlogits = TensorD::empty({T, E});
  router_backward(o, logits, probs, std::span<const std::int32_t>(index), w, r, stats, 1.0,
                  dlogits);
  expect_gradient("sinkhorn", logits, loss, dlogits);
}

}  // namespace
}  // namespace weave::ops
