// Blockwise attention: against a direct softmax(QK^T)V, finite differences, and chunked
// queries with offsets against the whole sequence.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "gradient_check.hpp"
#include "weave/ops/attention.hpp"

namespace weave::ops {
namespace {

using testing::dot;
using testing::expect_gradient;
using testing::random_tensor;
using testing::TensorD;

// softmax(scale Q K^T + causal mask) V, written the obvious way.
TensorD naive_attention(const TensorD& q, const TensorD& k, const TensorD& v, bool causal,
                        std::int64_t q_offset) {
  const std::int64_t B = q.dim(0), sq = q.dim(1), H = q.dim(2), d = q.dim(3), sk = k.dim(1);
  TensorD o = TensorD::zeros(q.shape());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < sq; ++i) {
        std::vector<double> s(sk, -std::numeric_limits<double>::infinity());
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < sk; ++j) {
          if (causal && j > q_offset + i) continue;
          double acc = 0;
          for (std::int64_t c = 0; c < d; ++c)
            acc += q(b, i, h, c) * k(b, j, h, c);
          s[j] = acc / std::sqrt(static_cast<double>(d));
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (auto& x : s)
          sum += (x = std::exp(x - m));
        for (std::int64_t j = 0; j < sk; ++j)
          for (std::int64_t c = 0; c < d; ++c)
            o(b, i, h, c) += s[j] / sum * v(b, j, h, c);
      }
  return o;
}

void expect_close(const TensorD& a, const TensorD& b, double tol, const char* what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  const auto x = a.to_vector(), y = b.to_vector();
  for (std::size_t i = 0; i < x.size(); ++i)
    ASSERT_NEAR(x[i], y[i], tol) << what << " element " << i;
}

class AttentionShapes : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(AttentionShapes, MatchesDirectComputation) {
  const auto [seq, d, causal] = GetParam();
  std::mt19937 gen(seq * 31 + d);
  const TensorD q = random_tensor({2, seq, 3, d}, gen), k = random_tensor({2, seq, 3, d}, gen),
                v = random_tensor({2, seq, 3, d}, gen);
  const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({2, 3, seq});
  attention_forward({.causal = causal}, q, k, v, o, lse);
  expect_close(o, naive_attention(q, k, v, causal, 0), 1e-12, "output");
}

// Sequence lengths around the 64-row blocks: one partial block, exact blocks, several blocks.
INSTANTIATE_TEST_SUITE_P(Blocks, AttentionShapes,
                         ::testing::Combine(::testing::Values(1, 7, 64, 65, 150),
                                            ::testing::Values(4, 16), ::testing::Bool()));

TEST(Attention, GradientsMatchFiniteDifferences) {
  std::mt19937 gen(3);
  // 70 positions: two key and query blocks, so the blockwise backward crosses block edges.
  const TensorD q = random_tensor({1, 70, 2, 4}, gen), k = random_tensor({1, 70, 2, 4}, gen),
                v = random_tensor({1, 70, 2, 4}, gen), r = random_tensor({1, 70, 2, 4}, gen);
  for (bool causal : {true, false}) {
    const AttentionOptions opt{.causal = causal};
    const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({1, 2, 70});
    auto loss = [&] {
      attention_forward(opt, q, k, v, o, lse);
      return dot(o, r);
    };
    loss();
    const TensorD dq = TensorD::empty(q.shape()), dk = TensorD::zeros(k.shape()),
                  dv = TensorD::zeros(v.shape());
    attention_backward(opt, q, k, v, o, lse, r, dq, dk, dv);
    expect_gradient("dq", q, loss, dq, 1e-6);
    expect_gradient("dk", k, loss, dk, 1e-6);
    expect_gradient("dv", v, loss, dv, 1e-6);
  }
}

TEST(Attention, QueryChunksWithOffsetsEqualTheWholeSequence) {
  std::mt19937 gen(4);
  const std::int64_t S = 100;
  const TensorD q = random_tensor({2, S, 2, 8}, gen), k = random_tensor({2, S, 2, 8}, gen),
                v = random_tensor({2, S, 2, 8}, gen), d_o = random_tensor({2, S, 2, 8}, gen);
  const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({2, 2, S});
  attention_forward({}, q, k, v, o, lse);
  const TensorD dq = TensorD::empty(q.shape()), dk = TensorD::zeros(k.shape()),
                dv = TensorD::zeros(v.shape());
  attention_backward({}, q, k, v, o, lse, d_o, dq, dk, dv);

  // Four uneven chunks of queries, each a view of q, against the whole keys and values.
  const std::int64_t bounds[] = {0, 13, 50, 64, S};
  const TensorD oc = TensorD::empty(q.shape()), dqc = TensorD::empty(q.shape()),
                dkc = TensorD::zeros(k.shape()), dvc = TensorD::zeros(v.shape());
  for (int c = 0; c < 4; ++c) {
    const std::int64_t start = bounds[c], len = bounds[c + 1] - bounds[c];
    const AttentionOptions opt{.q_offset = start};
    const TensorD lse_c = TensorD::empty({2, 2, len});
    attention_forward(opt, q.slice(1, start, len), k, v, oc.slice(1, start, len), lse_c);
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h)
        for (std::int64_t i = 0; i < len; ++i)
          EXPECT_NEAR(lse_c(b, h, i), lse(b, h, start + i), 1e-12);
    attention_backward(opt, q.slice(1, start, len), k, v, oc.slice(1, start, len), lse_c,
                       d_o.slice(1, start, len), dqc.slice(1, start, len), dkc, dvc);
  }
  expect_close(oc, o, 1e-12, "output");
  expect_close(dqc, dq, 1e-12, "dq");
  expect_close(dkc, dk, 1e-12, "dk");
  expect_close(dvc, dv, 1e-12, "dv");
}

TEST(Attention, KeyOffsetMasksKeysAfterTheQuery) {
  // Keys 40..79 of a sequence against queries 0..49: queries before position 40 see nothing.
  std::mt19937 gen(5);
  const TensorD q = random_tensor({1, 50, 1, 4}, gen), k = random_tensor({1, 40, 1, 4}, gen),
                v = random_tensor({1, 40, 1, 4}, gen);
  const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({1, 1, 50});
  attention_forward({.k_offset = 40}, q, k, v, o, lse);
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(lse(0, 0, i), -std::numeric_limits<double>::infinity());
    EXPECT_EQ(o(0, i, 0, 0), 0.0);
  }
  EXPECT_TRUE(std::isfinite(lse(0, 0, 40)));
  // Query 40 sees exactly key 0 (position 40): its output is that value row.
  for (int c = 0; c < 4; ++c)
    EXPECT_NEAR(o(0, 40, 0, c), v(0, 0, 0, c), 1e-15);
}

// Grouped-query attention: q [b, s, g, n d] against g key/value heads equals ordinary attention
// with each key/value head repeated for its n query heads; its key and value gradients are the
// repeated heads' gradients summed.
TEST(Attention, GroupedQueryAttentionEqualsRepeatedKeyValueHeads) {
  std::mt19937 gen(6);
  const std::int64_t B = 2, S = 70, G = 2, n = 3, d = 4;
  const TensorD q = random_tensor({B, S, G, n * d}, gen), k = random_tensor({B, S, G, d}, gen),
                v = random_tensor({B, S, G, d}, gen), d_o = random_tensor({B, S, G, n * d}, gen);
  const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({B, G * n, S});
  attention_forward({}, q, k, v, o, lse);
  const TensorD dq = TensorD::empty(q.shape()), dk = TensorD::zeros(k.shape()),
                dv = TensorD::zeros(v.shape());
  attention_backward({}, q, k, v, o, lse, d_o, dq, dk, dv);
  // The same as H = G n heads: q and o are the same memory read as [B, S, H, d].
  const TensorD kr = TensorD::empty({B, S, G * n, d}), vr = TensorD::empty(kr.shape());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < S; ++i)
      for (std::int64_t h = 0; h < G * n; ++h)
        for (std::int64_t c = 0; c < d; ++c) {
          kr(b, i, h, c) = k(b, i, h / n, c);
          vr(b, i, h, c) = v(b, i, h / n, c);
        }
  const TensorD qh = q.reshape({B, S, G * n, d}), doh = d_o.reshape({B, S, G * n, d});
  expect_close(o.reshape({B, S, G * n, d}), naive_attention(qh, kr, vr, true, 0), 1e-12, "output");
  const TensorD oh = TensorD::empty(qh.shape()), lseh = TensorD::empty({B, G * n, S});
  attention_forward({}, qh, kr, vr, oh, lseh);
  const TensorD dqh = TensorD::empty(qh.shape()), dkr = TensorD::zeros(kr.shape()),
                dvr = TensorD::zeros(vr.shape());
  attention_backward({}, qh, kr, vr, oh, lseh, doh, dqh, dkr, dvr);
  expect_close(dq.reshape(qh.shape()), dqh, 1e-12, "dq");
  const TensorD dk_sum = TensorD::zeros(k.shape()), dv_sum = TensorD::zeros(v.shape());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < S; ++i)
      for (std::int64_t h = 0; h < G * n; ++h)
        for (std::int64_t c = 0; c < d; ++c) {
          dk_sum(b, i, h / n, c) += dkr(b, i, h, c);
          dv_sum(b, i, h / n, c) += dvr(b, i, h, c);
        }
  expect_close(dk, dk_sum, 1e-12, "dk");
  expect_close(dv, dv_sum, 1e-12, "dv");
}

TEST(Attention, GroupedQueryGradientsMatchFiniteDifferences) {
  std::mt19937 gen(8);
  const TensorD q = random_tensor({1, 66, 1, 8}, gen), k = random_tensor({1, 66, 1, 4}, gen),
                v = random_tensor({1, 66, 1, 4}, gen), r = random_tensor({1, 66, 1, 8}, gen);
  const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({1, 2, 66});
  auto loss = [&] {
    attention_forward({}, q, k, v, o, lse);
    return dot(o, r);
  };
  loss();
  const TensorD dq = TensorD::empty(q.shape()), dk = TensorD::zeros(k.shape()),
                dv = TensorD::zeros(v.shape());
  attention_backward({}, q, k, v, o, lse, r, dq, dk, dv);
  expect_gradient("dq", q, loss, dq, 1e-6);
  expect_gradient("dk", k, loss, dk, 1e-6);
  expect_gradient("dv", v, loss, dv, 1e-6);
}

AttentionDropout probabilities_dropout(double p) {
  return {.probability = p,
          .key = {.seed = 42, .layer = 3, .site = 3},
          .sequence_length = 100,
          .batch_offset = 5,
          .head_offset = 2};
}

// Dropout on the probabilities: against softmax with the mask applied directly, finite
// differences (the mask is a pure function of the positions), and the kept share.
TEST(Attention, DropoutDropsProbabilitiesByTheirPositions) {
  std::mt19937 gen(9);
  const std::int64_t S = 100, H = 2, d = 4;
  const double p = 0.25;
  const AttentionOptions opt{.dropout = probabilities_dropout(p)};
  const TensorD q = random_tensor({1, S, H, d}, gen), k = random_tensor({1, S, H, d}, gen),
                v = random_tensor({1, S, H, d}, gen);
  const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({1, H, S});
  attention_forward(opt, q, k, v, o, lse);
  // Directly: P = softmax(causal scores), O = (P * keep / (1 - p)) V.
  std::int64_t kept = 0, seen = 0;
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < S; ++i) {
      std::vector<double> s(static_cast<std::size_t>(i + 1));
      double m = -std::numeric_limits<double>::infinity(), sum = 0;
      for (std::int64_t j = 0; j <= i; ++j) {
        double acc = 0;
        for (std::int64_t c = 0; c < d; ++c)
          acc += q(0, i, h, c) * k(0, j, h, c);
        s[j] = acc / 2;  // 1 / sqrt(4)
        m = std::max(m, s[j]);
      }
      for (auto& x : s)
        sum += (x = std::exp(x - m));
      for (std::int64_t c = 0; c < d; ++c) {
        double want = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          const bool keep =
              uniform(opt.dropout.key, static_cast<std::uint64_t>(5 * S + i),
                      static_cast<std::uint64_t>((2 + h) * S + j)) >= static_cast<float>(p);
          if (c == 0) {
            kept += keep;
            ++seen;
          }
          if (keep) want += s[j] / sum / (1 - p) * v(0, j, h, c);
        }
        EXPECT_NEAR(o(0, i, h, c), want, 1e-12) << "head " << h << " row " << i;
      }
    }
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(seen), 1 - p, 0.02);
  const TensorD r = random_tensor(q.shape(), gen);
  auto loss = [&] {
    attention_forward(opt, q, k, v, o, lse);
    return dot(o, r);
  };
  loss();
  const TensorD dq = TensorD::empty(q.shape()), dk = TensorD::zeros(k.shape()),
                dv = TensorD::zeros(v.shape());
  attention_backward(opt, q, k, v, o, lse, r, dq, dk, dv);
  expect_gradient("dq", q, loss, dq, 1e-6);
  expect_gradient("dk", k, loss, dk, 1e-6);
  expect_gradient("dv", v, loss, dv, 1e-6);
}

// A chunk of queries with its offset draws the whole sequence's mask at its positions.
TEST(Attention, DropoutOfAQueryChunkEqualsTheWholeSequences) {
  std::mt19937 gen(10);
  const std::int64_t S = 100;
  const AttentionOptions whole{.dropout = probabilities_dropout(0.3)};
  const TensorD q = random_tensor({1, S, 2, 4}, gen), k = random_tensor({1, S, 2, 4}, gen),
                v = random_tensor({1, S, 2, 4}, gen);
  const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({1, 2, S});
  attention_forward(whole, q, k, v, o, lse);
  const std::int64_t start = 37, len = 40;
  AttentionOptions chunk = whole;
  chunk.q_offset = start;
  const TensorD oc = TensorD::empty({1, len, 2, 4}), lse_c = TensorD::empty({1, 2, len});
  attention_forward(chunk, q.slice(1, start, len), k, v, oc, lse_c);
  expect_close(oc, o.slice(1, start, len).clone(), 1e-12, "chunk output");
}

TEST(Attention, BadShapesAreNamed) {
  // A query row of 6 dimensions per group is no whole number of 4-dimensional heads (8 would be
  // two query heads sharing each key head: grouped-query attention).
  const TensorD q = TensorD::zeros({1, 4, 2, 6}), k = TensorD::zeros({1, 4, 2, 4});
  const TensorD o = TensorD::empty(q.shape()), lse = TensorD::empty({1, 2, 4});
  try {
    attention_forward({}, q, k, k, o, lse);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[1, 4, 2, 4]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[1, 4, 2, 6]"), std::string::npos) << e.what();
  }
  // Keys of another group count than the queries'.
  const TensorD k3 = TensorD::zeros({1, 4, 3, 4});
  const TensorD q8 = TensorD::zeros({1, 4, 2, 8}), o8 = TensorD::empty(q8.shape());
  const TensorD lse4 = TensorD::empty({1, 4, 4});
  try {
    attention_forward({}, q8, k3, k3, o8, lse4);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[1, 4, 3, 4]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace weave::ops
