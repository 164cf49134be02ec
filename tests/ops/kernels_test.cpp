// Every kernel's backward against central finite differences in double precision, and the
// float kernels against the double ones.
#include <gtest/gtest.h>

#include <tbb/task_arena.h>

#include <random>
#include <vector>

#include "gradient_check.hpp"
#include "weave/ops/activation.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/bfloat16.hpp"
#include "weave/ops/cross_entropy.hpp"
#include "weave/ops/dropout.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/embedding.hpp"
#include "weave/ops/float16.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/normalization.hpp"
#include "weave/ops/softmax.hpp"

namespace weave::ops {
namespace {

using testing::dot;
using testing::expect_gradient;
using testing::random_tensor;
using testing::TensorD;

TEST(Linear, GradientsMatchFiniteDifferences) {
  std::mt19937 gen(1);
  const TensorD x = random_tensor({2, 3, 5}, gen), w = random_tensor({4, 5}, gen),
                b = random_tensor({4}, gen), r = random_tensor({2, 3, 4}, gen);
  const TensorD y = TensorD::empty({2, 3, 4});
  auto loss = [&] {
    linear_forward(x, w, b, y);
    return dot(y, r);
  };
  const TensorD dx = TensorD::empty(x.shape()), dw = TensorD::zeros(w.shape()),
                db = TensorD::zeros(b.shape());
  linear_backward_input(r, w, dx);
  linear_backward_weight(x, r, dw, db);
  expect_gradient("dx", x, loss, dx);
  expect_gradient("dw", w, loss, dw);
  expect_gradient("db", b, loss, db);
}

TEST(Linear, SequenceSliceViewMatchesContiguousCopy) {
  std::mt19937 gen(2);
  const TensorD full = random_tensor({3, 8, 6}, gen), w = random_tensor({5, 6}, gen);
  const TensorD view = full.slice(1, 2, 4);  // rows 2..5 of every batch entry: not contiguous
  ASSERT_FALSE(view.is_contiguous());
  const TensorD a = TensorD::empty({3, 4, 5}), c = TensorD::empty({3, 4, 5});
  linear_forward(view, w, TensorD{}, a);
  linear_forward(view.clone(), w, TensorD{}, c);
  // The view runs as three 4-row products, the copy as one 12-row product: equal up to rounding.
  const auto ya = a.to_vector(), yc = c.to_vector();
  for (std::size_t i = 0; i < ya.size(); ++i)
    EXPECT_NEAR(ya[i], yc[i], 1e-12);
  const TensorD dw1 = TensorD::zeros(w.shape()), dw2 = TensorD::zeros(w.shape());
  linear_backward_weight(view, a, dw1, TensorD{});
  linear_backward_weight(view.clone(), a, dw2, TensorD{});
  const auto g1 = dw1.to_vector(), g2 = dw2.to_vector();
  for (std::size_t i = 0; i < g1.size(); ++i)
    EXPECT_NEAR(g1[i], g2[i], 1e-12);
}

TEST(Linear, WeightGradientsAccumulate) {
  std::mt19937 gen(3);
  const TensorD x = random_tensor({4, 3}, gen), dy = random_tensor({4, 2}, gen);
  const TensorD once = TensorD::zeros({2, 3}), twice = TensorD::zeros({2, 3});
  linear_backward_weight(x, dy, once, TensorD{});
  linear_backward_weight(x, dy, twice, TensorD{});
  linear_backward_weight(x, dy, twice, TensorD{});
  const auto a = once.to_vector(), b = twice.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(b[i], 2 * a[i], 1e-12);
}

TEST(Linear, ShapeMismatchNamesBothShapes) {
  const TensorD x = TensorD::zeros({4, 3}), w = TensorD::zeros({2, 5}), y = TensorD::zeros({4, 2});
  try {
    linear_forward(x, w, TensorD{}, y);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[4, 3]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[4, 5]"), std::string::npos) << e.what();
  }
}

TEST(LayerNorm, GradientsMatchFiniteDifferences) {
  std::mt19937 gen(4);
  const TensorD x = random_tensor({3, 7}, gen), g = random_tensor({7}, gen),
                b = random_tensor({7}, gen), r = random_tensor({3, 7}, gen);
  const TensorD y = TensorD::empty(x.shape()), mean = TensorD::empty({3}),
                rstd = TensorD::empty({3});
  auto loss = [&] {
    layer_norm_forward(x, g, b, 1e-5, y, mean, rstd);
    return dot(y, r);
  };
  loss();
  const TensorD dx = TensorD::empty(x.shape()), dg = TensorD::zeros({7}), db = TensorD::zeros({7});
  layer_norm_backward(x, g, mean, rstd, r, dx, dg, db);
  expect_gradient("dx", x, loss, dx);
  expect_gradient("dgamma", g, loss, dg);
  expect_gradient("dbeta", b, loss, db);
}

TEST(RmsNorm, GradientsMatchFiniteDifferences) {
  std::mt19937 gen(5);
  const TensorD x = random_tensor({3, 6}, gen), g = random_tensor({6}, gen),
                r = random_tensor({3, 6}, gen);
  const TensorD y = TensorD::empty(x.shape()), rstd = TensorD::empty({3});
  auto loss = [&] {
    rms_norm_forward(x, g, 1e-6, y, rstd);
    return dot(y, r);
  };
  loss();
  const TensorD dx = TensorD::empty(x.shape()), dg = TensorD::zeros({6});
  rms_norm_backward(x, g, rstd, r, dx, dg);
  expect_gradient("dx", x, loss, dx);
  expect_gradient("dgamma", g, loss, dg);
}

TEST(Normalization, ParameterGradientsDoNotDependOnThreadCount) {
  // Fixed row blocks: the float sums come out bit for bit the same on 1 and 2 threads.
  std::mt19937 gen(6);
  const Tensor x = Tensor::empty({1000, 64}), dy = Tensor::empty({1000, 64});
  std::normal_distribution<float> dist;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    x.data()[i] = dist(gen);
    dy.data()[i] = dist(gen);
  }
  const Tensor g = Tensor::empty({64}), b = Tensor::zeros({64});
  g.fill(1.5f);
  const Tensor y = Tensor::empty(x.shape()), mean = Tensor::empty({1000}),
               rstd = Tensor::empty({1000});
  layer_norm_forward(x, g, b, 1e-5, y, mean, rstd);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2}) {
    tbb::task_arena arena(threads);
    const Tensor dg = Tensor::zeros({64}), db = Tensor::zeros({64}), dx = Tensor::empty(x.shape());
    arena.execute([&] { layer_norm_backward(x, g, mean, rstd, dy, dx, dg, db); });
    results.push_back(dg.to_vector());
  }
  EXPECT_EQ(results[0], results[1]);
}

class GeluTest : public ::testing::TestWithParam<GeluForm> {};

TEST_P(GeluTest, GradientMatchesFiniteDifferences) {
  std::mt19937 gen(7);
  const TensorD x = random_tensor({4, 9}, gen, -4, 4), r = random_tensor({4, 9}, gen);
  const TensorD y = TensorD::empty(x.shape());
  auto loss = [&] {
    gelu_forward(GetParam(), x, y);
    return dot(y, r);
  };
  const TensorD dx = TensorD::empty(x.shape());
  gelu_backward(GetParam(), x, r, dx);
  expect_gradient("dx", x, loss, dx);
}

INSTANTIATE_TEST_SUITE_P(Forms, GeluTest, ::testing::Values(GeluForm::tanh, GeluForm::erf));

TEST(Gelu, KnownValues) {
  const TensorD x = TensorD::from(std::vector<double>{-1.0, 0.0, 1.0, 2.0}, {4});
  const TensorD y = TensorD::empty({4});
  gelu_forward(GeluForm::erf, x, y);
  // 0.5 x (1 + erf(x / sqrt 2)), evaluated independently.
  EXPECT_NEAR(y.data()[0], -0.15865525393145707, 1e-15);
  EXPECT_EQ(y.data()[1], 0.0);
  EXPECT_NEAR(y.data()[2], 0.8413447460685429, 1e-15);
  EXPECT_NEAR(y.data()[3], 1.9544997361036416, 1e-15);
  gelu_forward(GeluForm::tanh, x, y);
  EXPECT_NEAR(y.data()[2], 0.8411919906082768, 1e-15);
}

TEST(SwiGlu, GradientMatchesFiniteDifferences) {
  std::mt19937 gen(8);
  const TensorD x = random_tensor({3, 10}, gen, -3, 3), r = random_tensor({3, 5}, gen);
  const TensorD y = TensorD::empty({3, 5});
  auto loss = [&] {
    swiglu_forward(x, y);
    return dot(y, r);
  };
  const TensorD dx = TensorD::empty(x.shape());
  swiglu_backward(x, r, dx);
  expect_gradient("dx", x, loss, dx);
}

TEST(SwiGlu, OddWidthIsRefused) {
  EXPECT_THROW(swiglu_forward(TensorD::zeros({2, 5}), TensorD::zeros({2, 2})),
               std::invalid_argument);
}

TEST(Softmax, GradientMatchesFiniteDifferences) {
  std::mt19937 gen(9);
  const TensorD x = random_tensor({3, 8}, gen, -3, 3), r = random_tensor({3, 8}, gen);
  const TensorD y = TensorD::empty(x.shape());
  auto loss = [&] {
    softmax_forward(x, y);
    return dot(y, r);
  };
  loss();
  const TensorD dx = TensorD::empty(x.shape());
  softmax_backward(y, r, dx);
  expect_gradient("dx", x, loss, dx);
}

TEST(ResidualAdd, SumsAndAccumulates) {
  const TensorD a = TensorD::from(std::vector<double>{1, 2, 3, 4}, {2, 2});
  const TensorD b = TensorD::from(std::vector<double>{10, 20, 30, 40}, {2, 2});
  const TensorD y = TensorD::empty({2, 2});
  add(a, b, y);
  EXPECT_EQ(y.to_vector(), (std::vector<double>{11, 22, 33, 44}));
  accumulate(a, y, 2.0);
  EXPECT_EQ(y.to_vector(), (std::vector<double>{13, 26, 39, 52}));
}

TEST(Embedding, GradientMatchesFiniteDifferences) {
  std::mt19937 gen(10);
  const TensorD table = random_tensor({7, 4}, gen), r = random_tensor({5, 4}, gen);
  const std::vector<std::int32_t> ids{3, 0, 3, 6, 1};
  const TensorD y = TensorD::empty({5, 4});
  auto loss = [&] {
    embedding_forward<double>(ids, table, {}, y);
    return dot(y, r);
  };
  const TensorD dtable = TensorD::zeros(table.shape());
  embedding_backward<double>(ids, r, {}, dtable);
  expect_gradient("dtable", table, loss, dtable);
}

TEST(Embedding, VocabShardsSumToTheWholeLookup) {
  std::mt19937 gen(11);
  const TensorD table = random_tensor({8, 3}, gen);
  const std::vector<std::int32_t> ids{7, 0, 4, 3, 5};
  const TensorD whole = TensorD::empty({5, 3});
  embedding_forward<double>(ids, table, {}, whole);
  const TensorD sum = TensorD::zeros({5, 3}), part = TensorD::empty({5, 3});
  for (int rank = 0; rank < 2; ++rank) {
    embedding_forward<double>(ids, table.slice(0, 4 * rank, 4), {4 * rank, 8}, part);
    accumulate(part, sum);
  }
  EXPECT_EQ(sum.to_vector(), whole.to_vector());
}

// A 16-bit table's lookup widened into fp32 (a 16-bit model's embedding): each row the fp32
// lookup of the table widened beforehand, bit for bit, in bf16 and fp16, a vocabulary shard's rows
// outside it zeros.
TEST(Embedding, WidenedLookupIsTheWidenedTablesLookup) {
  std::mt19937 gen(13);
  std::uniform_real_distribution<float> value(-2.f, 2.f);
  const std::vector<std::int32_t> ids{7, 0, 4, 3, 5, 4};
  const Tensor wide = Tensor::empty({8, 5});
  const Bf16Tensor table16 = Bf16Tensor::empty({8, 5});
  const Fp16Tensor table_fp16 = Fp16Tensor::empty({8, 5});
  const Tensor wide_fp16 = Tensor::empty({8, 5});
  for (std::int64_t i = 0; i < 40; ++i) {
    const float v = value(gen);
    table16.data()[i] = bf16(v);
    wide.data()[i] = static_cast<float>(bf16(v));
    table_fp16.data()[i] = fp16(v);
    wide_fp16.data()[i] = static_cast<float>(fp16(v));
  }
  for (int rank = 0; rank < 2; ++rank) {
    const EmbeddingShard shard{4 * rank, 8};
    const Tensor want = Tensor::empty({6, 5}), got = Tensor::empty({6, 5});
    embedding_forward<float>(ids, wide.slice(0, 4 * rank, 4), shard, want);
    embedding_forward_widened(ids, table16.slice(0, 4 * rank, 4), shard, got);
    EXPECT_EQ(got.to_vector(), want.to_vector()) << "bf16, rank " << rank;
    embedding_forward<float>(ids, wide_fp16.slice(0, 4 * rank, 4), shard, want);
    embedding_forward_widened(ids, table_fp16.slice(0, 4 * rank, 4), shard, got);
    EXPECT_EQ(got.to_vector(), want.to_vector()) << "fp16, rank " << rank;
  }
}

TEST(Embedding, OutOfRangeIdNamesItsPosition) {
  const std::vector<std::int32_t> ids{1, 9};
  try {
    embedding_forward<double>(ids, TensorD::zeros({8, 2}), {}, TensorD::empty({2, 2}));
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("position 1"), std::string::npos) << e.what();
  }
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  std::mt19937 gen(12);
  const TensorD logits = random_tensor({5, 7}, gen, -2, 2);
  const std::vector<std::int32_t> targets{3, -100, 0, 6, 2};
  for (double smoothing : {0.0, 0.1}) {
    const CrossEntropyOptions options{.label_smoothing = smoothing};
    const TensorD lse = TensorD::empty({5});
    auto loss = [&] { return cross_entropy_forward<double>(logits, targets, options, lse); };
    loss();
    const TensorD dlogits = TensorD::empty(logits.shape());
    cross_entropy_backward<double>(logits, targets, {}, lse, options, 1.0, dlogits);
    expect_gradient("dlogits", logits, loss, dlogits);
  }
}

TEST(CrossEntropy, VocabParallelStepsEqualTheWholeVocabulary) {
  std::mt19937 gen(13);
  const int ranks = 3, local = 5, n = 4;
  const TensorD logits = random_tensor({n, ranks * local}, gen, -3, 3);
  const std::vector<std::int32_t> targets{14, 2, -100, 7};
  const CrossEntropyOptions options{.label_smoothing = 0.2};
  const TensorD lse = TensorD::empty({n});
  const double whole = cross_entropy_forward<double>(logits, targets, options, lse);
  const TensorD dwhole = TensorD::empty(logits.shape());
  cross_entropy_backward<double>(logits, targets, {}, lse, options, 1.0, dwhole);

  // The group's reductions done serially here, as the all-reduces would.
  std::vector<TensorD> shards;
  for (int r = 0; r < ranks; ++r)
    shards.push_back(logits.slice(1, r * local, local).clone());
  const TensorD gmax = TensorD::empty({n}), m = TensorD::empty({n});
  gmax.fill(-1e300);
  for (const TensorD& s : shards) {
    cross_entropy_row_max(s, m);
    for (int i = 0; i < n; ++i)
      gmax.data()[i] = std::max(gmax.data()[i], m.data()[i]);
  }
  const TensorD sums = TensorD::zeros({n, kCrossEntropyPartials}),
                part = TensorD::empty({n, kCrossEntropyPartials});
  for (int r = 0; r < ranks; ++r) {
    cross_entropy_partial_sums<double>(shards[r], targets, {r * local, ranks * local}, gmax, part);
    accumulate(part, sums);
  }
  const TensorD lse2 = TensorD::empty({n});
  const double parallel =
      cross_entropy_loss<double>(gmax, sums, targets, ranks * local, options, lse2, TensorD{});
  EXPECT_NEAR(parallel, whole, 1e-12);
  for (int r = 0; r < ranks; ++r) {
    const TensorD d = TensorD::empty({n, local});
    cross_entropy_backward<double>(shards[r], targets, {r * local, ranks * local}, lse2, options,
                                   1.0, d);
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < local; ++j)
        EXPECT_NEAR(d(i, j), dwhole(i, r * local + j), 1e-12);
  }
}

TEST(CrossEntropy, BadTargetIsNamed) {
  const std::vector<std::int32_t> targets{0, 11};
  try {
    cross_entropy_forward<double>(TensorD::zeros({2, 5}), targets, {}, TensorD::empty({2}));
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("target 11 of row 1"), std::string::npos) << e.what();
  }
}

TEST(Dropout, ChunksAndShardsDrawTheWholeSequencesMask) {
  // The mask of a [2, 12, 8] tensor equals the masks of its sequence chunks and feature shards.
  const Tensor x = Tensor::empty({2, 12, 8});
  x.fill(1.f);
  DropoutSpec spec{.probability = 0.3, .key = {.seed = 42, .layer = 3, .site = 1}};
  const Tensor whole = Tensor::empty(x.shape());
  dropout_forward(spec, x, whole);
  int dropped = 0;
  for (float v : whole.to_vector()) {
    EXPECT_TRUE(v == 0.f || std::abs(v - 1.f / 0.7f) < 1e-6f);
    dropped += v == 0.f;
  }
  EXPECT_GT(dropped, 192 * 0.15);
  EXPECT_LT(dropped, 192 * 0.45);
  for (std::int64_t start : {0, 5, 9}) {
    const std::int64_t length = start == 0 ? 5 : start == 5 ? 4 : 3;
    for (std::int64_t f0 : {0, 3}) {
      const std::int64_t width = f0 == 0 ? 3 : 5;
      const Tensor part = x.slice(1, start, length).slice(2, f0, width).clone();
      DropoutSpec s = spec;
      s.sequence_offset = start;
      s.sequence_length = 12;
      s.feature_offset = f0;
      const Tensor out = Tensor::empty(part.shape());
      dropout_forward(s, part, out);
      EXPECT_EQ(out.to_vector(), whole.slice(1, start, length).slice(2, f0, width).to_vector())
          << "chunk at " << start << ", features from " << f0;
    }
  }
  // Another site draws another mask.
  DropoutSpec other = spec;
  other.key.site = 2;
  const Tensor y = Tensor::empty(x.shape());
  dropout_forward(other, x, y);
  EXPECT_NE(y.to_vector(), whole.to_vector());
}

TEST(Dropout, BackwardAppliesTheSameMask) {
  std::mt19937 gen(14);
  const TensorD x = random_tensor({6, 10}, gen), r = random_tensor({6, 10}, gen);
  const DropoutSpec spec{.probability = 0.5, .key = {.seed = 7}};
  const TensorD y = TensorD::empty(x.shape());
  auto loss = [&] {
    dropout_forward(spec, x, y);
    return dot(y, r);
  };
  const TensorD dx = TensorD::empty(x.shape());
  dropout_backward(spec, r, dx);
  expect_gradient("dx", x, loss, dx);
}

TEST(Tensor, TransposedViewFeedsAttentionAsTheCopyWould) {
  // A Megatron-layout [s, b, h, d] tensor seen as [b, s, h, d] without copying.
  std::mt19937 gen(15);
  const TensorD sbhd = random_tensor({6, 2, 3, 4}, gen);
  const TensorD bshd = sbhd.transpose(0, 1);
  EXPECT_EQ(bshd.shape(), (Shape{2, 6, 3, 4}));
  EXPECT_EQ(bshd(1, 4, 2, 3), sbhd(4, 1, 2, 3));
  EXPECT_FALSE(bshd.is_contiguous());
  const TensorD o1 = TensorD::empty({2, 6, 3, 4}), o2 = TensorD::empty({2, 6, 3, 4});
  const TensorD l1 = TensorD::empty({2, 3, 6}), l2 = TensorD::empty({2, 3, 6});
  attention_forward({}, bshd, bshd, bshd, o1, l1);
  const TensorD copy = bshd.clone();
  attention_forward({}, copy, copy, copy, o2, l2);
  const auto a = o1.to_vector(), b = o2.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-14);
}

TEST(Tensor, ViewsShareStorageAndReshapeNeedsContiguity) {
  const Tensor t = Tensor::zeros({2, 4, 3});
  const Tensor v = t.slice(1, 1, 2);
  v(1, 0, 2) = 5.f;
  EXPECT_EQ(t(1, 1, 2), 5.f);
  EXPECT_THROW(v.reshape({12}), std::invalid_argument);
  EXPECT_EQ(t.slice(0, 1, 1).reshape({4, 3})(1, 2), 5.f);
  EXPECT_THROW(t.slice(1, 3, 2), std::out_of_range);
  EXPECT_THROW(Tensor::zeros({1, 2, 3, 4, 5}), std::invalid_argument);
}

}  // namespace
}  // namespace weave::ops
