#include "weave/ops/cross_entropy.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "parallel_rows.hpp"

namespace weave::ops {

namespace {

template <typename T>
void check_logits(const BasicTensor<T>& logits, std::span<const std::int32_t> targets) {
  check_rows("cross_entropy logits", logits);
  if (logits.rank() != 2)
    throw std::invalid_argument(
        fmt::format("cross_entropy logits must be [tokens, vocab], got {}", logits.shape().str()));
  if (static_cast<std::int64_t>(targets.size()) != logits.dim(0))
    throw std::invalid_argument(fmt::format("cross_entropy: {} targets for logits of shape {}",
                                            targets.size(), logits.shape().str()));
}

std::int64_t whole_vocab(const VocabShard& shard, std::int64_t local) {
  const std::int64_t v = shard.vocab_size > 0 ? shard.vocab_size : local;
  if (shard.vocab_start < 0 || shard.vocab_start + local > v)
    throw std::invalid_argument(fmt::format(
        "cross_entropy: the shard's vocabulary [{}, {}) lies outside the vocabulary of {}",
        shard.vocab_start, shard.vocab_start + local, v));
  return v;
}

void check_options(const CrossEntropyOptions& o) {
  if (!(o.label_smoothing >= 0 && o.label_smoothing < 1))
    throw std::invalid_argument(
        fmt::format("cross_entropy label_smoothing must be in [0, 1), got {}", o.label_smoothing));
  if (o.denominator < 0)
    throw std::invalid_argument(
        fmt::format("cross_entropy denominator must be >= 0, got {}", o.denominator));
}

void check_target(std::int32_t t, std::size_t row, std::int64_t vocab,
                  const CrossEntropyOptions& o) {
  if (t != o.ignore_index && (t < 0 || t >= vocab))
    throw std::invalid_argument(fmt::format(
        "cross_entropy: target {} of row {} is outside the vocabulary [0, {}) and is not the "
        "ignore index {}",
        t, row, vocab, o.ignore_index));
}

double denominator(std::span<const std::int32_t> targets, const CrossEntropyOptions& o) {
  if (o.denominator > 0) return o.denominator;
  return static_cast<double>(
      std::count_if(targets.begin(), targets.end(), [&](auto t) { return t != o.ignore_index; }));
}

}  // namespace

template <typename T>
void cross_entropy_row_max(const BasicTensor<T>& logits, const BasicTensor<T>& row_max) {
  check_rows("cross_entropy logits", logits);
  check_shape("cross_entropy row maxima", row_max.shape(), Shape{logits.rows()});
  const std::int64_t v = logits.dim(-1);
  for (std::int64_t r = 0; r < logits.rows(); ++r) {
    const T* x = logits.row(r);
    T m = -std::numeric_limits<T>::infinity();
    for (std::int64_t i = 0; i < v; ++i)
      m = std::max(m, x[i]);
    row_max.data()[r] = m;
  }
}

template <typename T>
void cross_entropy_partial_sums(const BasicTensor<T>& logits, std::span<const std::int32_t> targets,
                                const VocabShard& shard, const BasicTensor<T>& global_max,
                                const BasicTensor<T>& partials) {
  check_logits(logits, targets);
  const std::int64_t n = logits.dim(0), v = logits.dim(1);
  whole_vocab(shard, v);
  check_shape("cross_entropy row maxima", global_max.shape(), Shape{n});
  check_shape("cross_entropy partial sums", partials.shape(), Shape{n, kCrossEntropyPartials});
  detail::for_row_blocks(n, 16, 12.0 * v, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* x = logits.row(r);
      const T m = global_max.data()[r];
      double sum_exp = 0, sum_logits = 0;
      for (std::int64_t i = 0; i < v; ++i) {
        sum_exp += std::exp(x[i] - m);
        sum_logits += x[i];
      }
      const std::int64_t local = targets[static_cast<std::size_t>(r)] - shard.vocab_start;
      T* p = partials.row(r);
      p[0] = static_cast<T>(sum_exp);
      p[1] = local >= 0 && local < v ? x[local] : T(0);
      p[2] = static_cast<T>(sum_logits);
    }
  });
}

template <typename T>
double cross_entropy_loss(const BasicTensor<T>& global_max, const BasicTensor<T>& partials,
                          std::span<const std::int32_t> targets, std::int64_t vocab_size,
                          const CrossEntropyOptions& options, const BasicTensor<T>& lse,
                          const BasicTensor<T>& losses) {
  check_options(options);
  const auto n = static_cast<std::int64_t>(targets.size());
  check_shape("cross_entropy row maxima", global_max.shape(), Shape{n});
  check_shape("cross_entropy partial sums", partials.shape(), Shape{n, kCrossEntropyPartials});
  check_shape("cross_entropy log-sum-exp", lse.shape(), Shape{n});
  if (losses.defined()) check_shape("cross_entropy per-row losses", losses.shape(), Shape{n});
  const double eps = options.label_smoothing;
  double total = 0;
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int32_t t = targets[static_cast<std::size_t>(r)];
    check_target(t, static_cast<std::size_t>(r), vocab_size, options);
    const T* p = partials.row(r);
    const double l =
        static_cast<double>(global_max.data()[r]) + std::log(static_cast<double>(p[0]));
    lse.data()[r] = static_cast<T>(l);
    double loss = 0;
    if (t != options.ignore_index)
      loss =
          l - (1 - eps) * p[1] - eps * static_cast<double>(p[2]) / static_cast<double>(vocab_size);
    if (losses.defined()) losses.data()[r] = static_cast<T>(loss);
    total += loss;
  }
  const double d = denominator(targets, options);
  return d > 0 ? total / d : 0.0;
}

template <typename T>
void cross_entropy_backward(const BasicTensor<T>& logits, std::span<const std::int32_t> targets,
                            const VocabShard& shard, const BasicTensor<T>& lse,
                            const CrossEntropyOptions& options, double loss_scale,
                            const BasicTensor<T>& dlogits) {
  check_logits(logits, targets);
  check_options(options);
  const std::int64_t n = logits.dim(0), v = logits.dim(1);
  const std::int64_t vocab = whole_vocab(shard, v);
  check_shape("cross_entropy log-sum-exp", lse.shape(), Shape{n});
  check_rows("cross_entropy logits gradient", dlogits);
  check_shape("cross_entropy logits gradient", dlogits.shape(), logits.shape());
  const double d = denominator(targets, options);
  const T scale = static_cast<T>(d > 0 ? loss_scale / d : 0.0);
  const T eps = static_cast<T>(options.label_smoothing);
  const T smooth = eps / static_cast<T>(vocab);
  detail::for_row_blocks(n, 16, 10.0 * v, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int32_t t = targets[static_cast<std::size_t>(r)];
      T* g = dlogits.row(r);
      if (t == options.ignore_index) {
        std::fill_n(g, v, T(0));
        continue;
      }
      const T* x = logits.row(r);
      const T l = lse.data()[r];
      for (std::int64_t i = 0; i < v; ++i)
        g[i] = scale * (std::exp(x[i] - l) - smooth);
      const std::int64_t local = t - shard.vocab_start;
      if (local >= 0 && local < v) g[local] -= scale * (T(1) - eps);
    }
  });
}

template <typename T>
double cross_entropy_forward(const BasicTensor<T>& logits, std::span<const std::int32_t> targets,
                             const CrossEntropyOptions& options, const BasicTensor<T>& lse) {
  check_logits(logits, targets);
  const std::int64_t n = logits.dim(0);
  BasicTensor<T> row_max = BasicTensor<T>::empty({n});
  BasicTensor<T> partials = BasicTensor<T>::empty({n, kCrossEntropyPartials});
  cross_entropy_row_max(logits, row_max);
  cross_entropy_partial_sums(logits, targets, VocabShard{}, row_max, partials);
  return cross_entropy_loss(row_max, partials, targets, logits.dim(1), options, lse,
                            BasicTensor<T>{});
}

#define WEAVE_INSTANTIATE(T)                                                                       \
  template void cross_entropy_row_max(const BasicTensor<T>&, const BasicTensor<T>&);               \
  template void cross_entropy_partial_sums(const BasicTensor<T>&, std::span<const std::int32_t>,   \
                                           const VocabShard&, const BasicTensor<T>&,               \
                                           const BasicTensor<T>&);                                 \
  template double cross_entropy_loss(                                                              \
      const BasicTensor<T>&, const BasicTensor<T>&, std::span<const std::int32_t>, std::int64_t,   \
      const CrossEntropyOptions&, const BasicTensor<T>&, const BasicTensor<T>&);                   \
  template void cross_entropy_backward(const BasicTensor<T>&, std::span<const std::int32_t>,       \
                                       const VocabShard&, const BasicTensor<T>&,                   \
                                       const CrossEntropyOptions&, double, const BasicTensor<T>&); \
  template double cross_entropy_forward(const BasicTensor<T>&, std::span<const std::int32_t>,      \
                                        const CrossEntropyOptions&, const BasicTensor<T>&);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

}  // namespace weave::ops
