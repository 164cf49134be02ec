#include "weave/ops/attention.hpp"

#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "weave/runtime/parallel_for.hpp"

namespace weave::ops {

namespace {

// Query and key block sizes: a 64 x 64 score block and its operands stay in L1/L2.
constexpr std::int64_t kQueryBlock = 64;
constexpr std::int64_t kKeyBlock = 64;

template <typename T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using RowsMap = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using ConstRowsMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

// Rows [first, first + count) of head `head` (d columns from column head d) of group g of batch
// entry b of a [b, s, g, n d] tensor.
template <typename T>
ConstRowsMap<T> rows_of(const BasicTensor<T>& t, std::int64_t b, std::int64_t g, std::int64_t head,
                        std::int64_t d, std::int64_t first, std::int64_t count) {
  return ConstRowsMap<T>(
      t.data() + b * t.stride(0) + first * t.stride(1) + g * t.stride(2) + head * d, count, d,
      Eigen::OuterStride<>(t.stride(1)));
}
template <typename T>
RowsMap<T> mutable_rows_of(const BasicTensor<T>& t, std::int64_t b, std::int64_t g,
                           std::int64_t head, std::int64_t d, std::int64_t first,
                           std::int64_t count) {
  return RowsMap<T>(t.data() + b * t.stride(0) + first * t.stride(1) + g * t.stride(2) + head * d,
                    count, d, Eigen::OuterStride<>(t.stride(1)));
}

template <typename T>
void check_bshd(const char* what, const BasicTensor<T>& t) {
  check_rows(what, t);
  if (t.rank() != 4)
    throw std::invalid_argument(fmt::format(
        "attention {} must be [batch, sequence, heads, head_dim], got {}", what, t.shape().str()));
}

// Query heads per key/value head: q's last dimension over k's.
template <typename T>
std::int64_t heads_per_group(const BasicTensor<T>& q, const BasicTensor<T>& k) {
  if (k.dim(3) == 0 || q.dim(3) % k.dim(3) != 0)
    throw std::invalid_argument(fmt::format(
        "attention query {} and key {}: each query group must hold a whole number of heads of "
        "the key's {} dimensions",
        q.shape().str(), k.shape().str(), k.dim(3)));
  return q.dim(3) / k.dim(3);
}

template <typename T>
void check_attention(const AttentionOptions& opt, const BasicTensor<T>& q, const BasicTensor<T>& k,
                     const BasicTensor<T>& v, const BasicTensor<T>& o, const BasicTensor<T>& lse) {
  check_bshd("query", q);
  check_bshd("key", k);
  check_bshd("value", v);
  check_bshd("output", o);
  const std::int64_t n = heads_per_group(q, k);
  const Shape kv = q.shape().with(1, k.dim(1)).with(3, k.dim(3));
  check_shape("attention key", k.shape(), kv);
  check_shape("attention value", v.shape(), kv);
  check_shape("attention output", o.shape(), q.shape());
  check_shape("attention log-sum-exp", lse.shape(), Shape{q.dim(0), q.dim(2) * n, q.dim(1)});
  if (!lse.is_contiguous())
    throw std::invalid_argument("attention log-sum-exp must be a contiguous tensor");
  if (opt.q_offset < 0 || opt.k_offset < 0 || opt.scale < 0)
    throw std::invalid_argument(fmt::format(
        "attention offsets and scale must be >= 0, got q_offset {}, k_offset {}, scale {}",
        opt.q_offset, opt.k_offset, opt.scale));
  const AttentionDropout& drop = opt.dropout;
  if (drop.probability < 0 || drop.probability >= 1)
    throw std::invalid_argument(
        fmt::format("attention dropout must be in [0, 1), got {}", drop.probability));
  if (drop.probability > 0) {
    check_random_key(drop.key);
    if (drop.sequence_length < opt.q_offset + q.dim(1) ||
        drop.sequence_length < opt.k_offset + k.dim(1))
      throw std::invalid_argument(fmt::format(
          "attention dropout's sequence length {} must cover the query and key positions",
          drop.sequence_length));
  }
}

template <typename T>
T scale_of(const AttentionOptions& opt, std::int64_t d) {
  return static_cast<T>(opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(d)));
}

// Keys [0, visible) are the ones query row `row` may see (all of them without a mask).
std::int64_t visible_keys(const AttentionOptions& opt, std::int64_t row, std::int64_t sk) {
  if (!opt.causal) return sk;
  return std::clamp<std::int64_t>(opt.q_offset + row - opt.k_offset + 1, 0, sk);
}

// The dropout mask's factors for query row i (of batch entry b, query head `head`) and key
// columns [j0, j0 + cols): 0 where dropped, 1 / (1 - p) where kept. Four consecutive features
// share one Philox block, so a row costs a quarter of a draw per key.
template <typename T>
struct DropoutMask {
  const AttentionOptions& opt;
  T keep_scale = T(1);
  explicit DropoutMask(const AttentionOptions& o)
      : opt(o), keep_scale(static_cast<T>(1.0 / (1.0 - o.dropout.probability))) {}
  bool active() const { return opt.dropout.probability > 0; }
  void row(std::int64_t b, std::int64_t head, std::int64_t i, std::int64_t j0, std::int64_t cols,
           T* out) const {
    const AttentionDropout& d = opt.dropout;
    const auto token =
        static_cast<std::uint64_t>((d.batch_offset + b) * d.sequence_length + opt.q_offset + i);
    const auto first =
        static_cast<std::uint64_t>((d.head_offset + head) * d.sequence_length + opt.k_offset + j0);
    const float p = static_cast<float>(d.probability);
    float u[4];
    std::uint64_t quad = ~std::uint64_t{0};
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::uint64_t feature = first + static_cast<std::uint64_t>(j);
      if (feature / 4 != quad) {
        quad = feature / 4;
        uniform4(d.key, token, quad, u);
      }
      out[j] = u[feature % 4] >= p ? keep_scale : T(0);
    }
  }
};

}  // namespace

template <typename T>
void attention_forward(const AttentionOptions& opt, const BasicTensor<T>& q,
                       const BasicTensor<T>& k, const BasicTensor<T>& v, const BasicTensor<T>& o,
                       const BasicTensor<T>& lse) {
  check_attention(opt, q, k, v, o, lse);
  const std::int64_t n = heads_per_group(q, k);
  const std::int64_t B = q.dim(0), sq = q.dim(1), H = q.dim(2) * n, d = k.dim(3), sk = k.dim(1);
  const T scale = scale_of<T>(opt, d);
  const std::int64_t qblocks = (sq + kQueryBlock - 1) / kQueryBlock;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const DropoutMask<T> mask(opt);
  auto block = [&](std::int64_t index) {
    const std::int64_t qb = index % qblocks, bh = index / qblocks;
    const std::int64_t b = bh / H, h = bh % H, g = h / n, head = h % n;
    const std::int64_t i0 = qb * kQueryBlock, rows = std::min(kQueryBlock, sq - i0);
    const auto Q = rows_of(q, b, g, head, d, i0, rows);
    Matrix<T> acc = Matrix<T>::Zero(rows, d);
    Eigen::Array<T, Eigen::Dynamic, 1> m =
        Eigen::Array<T, Eigen::Dynamic, 1>::Constant(rows, kNegInf);
    Eigen::Array<T, Eigen::Dynamic, 1> l = Eigen::Array<T, Eigen::Dynamic, 1>::Zero(rows);
    const std::int64_t keys = visible_keys(opt, i0 + rows - 1, sk);
    Matrix<T> s;
    std::vector<T> keep;
    for (std::int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
      const std::int64_t cols = std::min(kKeyBlock, keys - j0);
      s.noalias() = scale * Q * rows_of(k, b, g, 0, d, j0, cols).transpose();
      for (std::int64_t i = 0; i < rows; ++i) {
        const std::int64_t seen = visible_keys(opt, i0 + i, sk) - j0;
        for (std::int64_t j = std::max<std::int64_t>(seen, 0); j < cols; ++j)
          s(i, j) = kNegInf;
        const T block_max = seen > 0 ? s.row(i).maxCoeff() : kNegInf;
        const T m_new = std::max(m(i), block_max);
        if (m_new == kNegInf) {  // nothing seen yet by this row: it adds nothing
          s.row(i).setZero();
          continue;
        }
        const T rescale = std::exp(m(i) - m_new);
        s.row(i) = (s.row(i).array() - m_new).exp().matrix();
        // The normaliser sums every probability; only the output sees the dropped ones go.
        l(i) = l(i) * rescale + s.row(i).sum();
        acc.row(i) *= rescale;
        m(i) = m_new;
        if (mask.active()) {
          const std::int64_t n = std::min<std::int64_t>(std::max<std::int64_t>(seen, 0), cols);
          keep.resize(static_cast<std::size_t>(n));
          mask.row(b, h, i0 + i, j0, n, keep.data());
          for (std::int64_t j = 0; j < n; ++j)
            s(i, j) *= keep[static_cast<std::size_t>(j)];
        }
      }
      acc.noalias() += s * rows_of(v, b, g, 0, d, j0, cols);
    }
    auto out = mutable_rows_of(o, b, g, head, d, i0, rows);
    T* lse_row = lse.data() + (b * H + h) * sq + i0;
    for (std::int64_t i = 0; i < rows; ++i) {
      if (l(i) > T(0)) {
        out.row(i) = acc.row(i) / l(i);
        lse_row[i] = m(i) + std::log(l(i));
      } else {
        out.row(i).setZero();
        lse_row[i] = kNegInf;
      }
    }
  };
  rt::parallel_for(std::int64_t{0}, B * H * qblocks, block);
}

template <typename T>
void attention_backward(const AttentionOptions& opt, const BasicTensor<T>& q,
                        const BasicTensor<T>& k, const BasicTensor<T>& v, const BasicTensor<T>& o,
                        const BasicTensor<T>& lse, const BasicTensor<T>& d_o,
                        const BasicTensor<T>& dq, const BasicTensor<T>& dk,
                        const BasicTensor<T>& dv) {
  check_attention(opt, q, k, v, o, lse);
  check_bshd("output gradient", d_o);
  check_bshd("query gradient", dq);
  check_bshd("key gradient", dk);
  check_bshd("value gradient", dv);
  check_shape("attention output gradient", d_o.shape(), q.shape());
  check_shape("attention query gradient", dq.shape(), q.shape());
  check_shape("attention key gradient", dk.shape(), k.shape());
  check_shape("attention value gradient", dv.shape(), v.shape());
  const std::int64_t n = heads_per_group(q, k);
  const std::int64_t B = q.dim(0), sq = q.dim(1), G = q.dim(2), H = G * n, d = k.dim(3);
  const std::int64_t sk = k.dim(1);
  const T scale = scale_of<T>(opt, d);
  const DropoutMask<T> mask(opt);
  // One (batch, key/value head) per task: its key blocks, and within each its query heads, run
  // in order, so every sum has a fixed order.
  auto group = [&](std::int64_t bg) {
    const std::int64_t b = bg / G, g = bg % G;
    // D_i = rowsum(dO_i * O_i) per query head: the softmax backward's correction term (with
    // dropout, O already holds the dropped probabilities' sum, so the same term serves).
    std::vector<Eigen::Array<T, Eigen::Dynamic, 1>> D(static_cast<std::size_t>(n));
    std::vector<Matrix<T>> dQ(static_cast<std::size_t>(n));
    for (std::int64_t head = 0; head < n; ++head) {
      auto& Dh = D[static_cast<std::size_t>(head)];
      Dh.resize(sq);
      const auto O = rows_of(o, b, g, head, d, 0, sq);
      const auto dO = rows_of(d_o, b, g, head, d, 0, sq);
      for (std::int64_t i = 0; i < sq; ++i)
        Dh(i) = O.row(i).dot(dO.row(i));
      dQ[static_cast<std::size_t>(head)] = Matrix<T>::Zero(sq, d);
    }
    Matrix<T> s, dp;
    for (std::int64_t j0 = 0; j0 < sk; j0 += kKeyBlock) {
      const std::int64_t cols = std::min(kKeyBlock, sk - j0);
      const auto K = rows_of(k, b, g, 0, d, j0, cols);
      const auto V = rows_of(v, b, g, 0, d, j0, cols);
      Matrix<T> dK = Matrix<T>::Zero(cols, d), dV = Matrix<T>::Zero(cols, d);
      // The first query row that sees key j0.
      std::int64_t first = 0;
      if (opt.causal) first = std::clamp<std::int64_t>(opt.k_offset + j0 - opt.q_offset, 0, sq);
      for (std::int64_t head = 0; head < n; ++head) {
        const std::int64_t h = g * n + head;
        const T* lse_row = lse.data() + (b * H + h) * sq;
        const auto& Dh = D[static_cast<std::size_t>(head)];
        Matrix<T>& dQh = dQ[static_cast<std::size_t>(head)];
        for (std::int64_t i0 = first; i0 < sq; i0 += kQueryBlock) {
          const std::int64_t rows = std::min(kQueryBlock, sq - i0);
          const auto Q = rows_of(q, b, g, head, d, i0, rows);
          const auto dO = rows_of(d_o, b, g, head, d, i0, rows);
          s.noalias() = scale * Q * K.transpose();
          for (std::int64_t i = 0; i < rows; ++i) {
            const std::int64_t seen = visible_keys(opt, i0 + i, sk) - j0;
            const T l = lse_row[i0 + i];
            for (std::int64_t j = 0; j < cols; ++j)
              s(i, j) = j < seen && l != -std::numeric_limits<T>::infinity() ? std::exp(s(i, j) - l)
                                                                             : T(0);
          }
          dp.noalias() = dO * V.transpose();
          if (mask.active()) {
            // P's dropped form feeds V's gradient; the mask scales dP the same way.
            Matrix<T> kept(rows, cols);
            for (std::int64_t i = 0; i < rows; ++i)
              mask.row(b, h, i0 + i, j0, cols, &kept(i, 0));
            dV.noalias() += (s.array() * kept.array()).matrix().transpose() * dO;
            dp.array() *= kept.array();
          } else {
            dV.noalias() += s.transpose() * dO;
          }
          for (std::int64_t i = 0; i < rows; ++i)
            dp.row(i) = (s.row(i).array() * (dp.row(i).array() - Dh(i0 + i))).matrix();
          dQh.middleRows(i0, rows).noalias() += scale * dp * K;
          dK.noalias() += scale * dp.transpose() * Q;
        }
      }
      mutable_rows_of(dk, b, g, 0, d, j0, cols) += dK;
      mutable_rows_of(dv, b, g, 0, d, j0, cols) += dV;
    }
    for (std::int64_t head = 0; head < n; ++head)
      mutable_rows_of(dq, b, g, head, d, 0, sq) = dQ[static_cast<std::size_t>(head)];
  };
  rt::parallel_for(std::int64_t{0}, B * G, group);
}

#define WEAVE_INSTANTIATE(T)                                                                      \
  template void attention_forward(const AttentionOptions&, const BasicTensor<T>&,                 \
                                  const BasicTensor<T>&, const BasicTensor<T>&,                   \
                                  const BasicTensor<T>&, const BasicTensor<T>&);                  \
  template void attention_backward(                                                               \
      const AttentionOptions&, const BasicTensor<T>&, const BasicTensor<T>&,                      \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&, \
      const BasicTensor<T>&, const BasicTensor<T>&, const BasicTensor<T>&);
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)

}  // namespace weave::ops
