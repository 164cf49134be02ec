#include "weave/ops/attention.hpp"

#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

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

// Rows [first, first + count) of head h of batch entry b of a [b, s, h, d] tensor.
template <typename T>
ConstRowsMap<T> rows_of(const BasicTensor<T>& t, std::int64_t b, std::int64_t h, std::int64_t first,
                        std::int64_t count) {
  return ConstRowsMap<T>(t.data() + b * t.stride(0) + first * t.stride(1) + h * t.stride(2), count,
                         t.dim(3), Eigen::OuterStride<>(t.stride(1)));
}
template <typename T>
RowsMap<T> mutable_rows_of(const BasicTensor<T>& t, std::int64_t b, std::int64_t h,
                           std::int64_t first, std::int64_t count) {
  return RowsMap<T>(t.data() + b * t.stride(0) + first * t.stride(1) + h * t.stride(2), count,
                    t.dim(3), Eigen::OuterStride<>(t.stride(1)));
}

template <typename T>
void check_bshd(const char* what, const BasicTensor<T>& t) {
  check_rows(what, t);
  if (t.rank() != 4)
    throw std::invalid_argument(fmt::format(
        "attention {} must be [batch, sequence, heads, head_dim], got {}", what, t.shape().str()));
}

template <typename T>
void check_attention(const AttentionOptions& opt, const BasicTensor<T>& q, const BasicTensor<T>& k,
                     const BasicTensor<T>& v, const BasicTensor<T>& o, const BasicTensor<T>& lse) {
  check_bshd("query", q);
  check_bshd("key", k);
  check_bshd("value", v);
  check_bshd("output", o);
  const Shape kv = q.shape().with(1, k.dim(1));
  check_shape("attention key", k.shape(), kv);
  check_shape("attention value", v.shape(), kv);
  check_shape("attention output", o.shape(), q.shape());
  check_shape("attention log-sum-exp", lse.shape(), Shape{q.dim(0), q.dim(2), q.dim(1)});
  if (!lse.is_contiguous())
    throw std::invalid_argument("attention log-sum-exp must be a contiguous tensor");
  if (opt.q_offset < 0 || opt.k_offset < 0 || opt.scale < 0)
    throw std::invalid_argument(fmt::format(
        "attention offsets and scale must be >= 0, got q_offset {}, k_offset {}, scale {}",
        opt.q_offset, opt.k_offset, opt.scale));
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

}  // namespace

template <typename T>
void attention_forward(const AttentionOptions& opt, const BasicTensor<T>& q,
                       const BasicTensor<T>& k, const BasicTensor<T>& v, const BasicTensor<T>& o,
                       const BasicTensor<T>& lse) {
  check_attention(opt, q, k, v, o, lse);
  const std::int64_t B = q.dim(0), sq = q.dim(1), H = q.dim(2), d = q.dim(3), sk = k.dim(1);
  const T scale = scale_of<T>(opt, d);
  const std::int64_t qblocks = (sq + kQueryBlock - 1) / kQueryBlock;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  auto block = [&](std::int64_t index) {
    const std::int64_t qb = index % qblocks, bh = index / qblocks;
    const std::int64_t b = bh / H, h = bh % H;
    const std::int64_t i0 = qb * kQueryBlock, rows = std::min(kQueryBlock, sq - i0);
    const auto Q = rows_of(q, b, h, i0, rows);
    Matrix<T> acc = Matrix<T>::Zero(rows, d);
    Eigen::Array<T, Eigen::Dynamic, 1> m =
        Eigen::Array<T, Eigen::Dynamic, 1>::Constant(rows, kNegInf);
    Eigen::Array<T, Eigen::Dynamic, 1> l = Eigen::Array<T, Eigen::Dynamic, 1>::Zero(rows);
    const std::int64_t keys = visible_keys(opt, i0 + rows - 1, sk);
    Matrix<T> s;
    for (std::int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
      const std::int64_t cols = std::min(kKeyBlock, keys - j0);
      s.noalias() = scale * Q * rows_of(k, b, h, j0, cols).transpose();
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
        l(i) = l(i) * rescale + s.row(i).sum();
        acc.row(i) *= rescale;
        m(i) = m_new;
      }
      acc.noalias() += s * rows_of(v, b, h, j0, cols);
    }
    auto out = mutable_rows_of(o, b, h, i0, rows);
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
  const std::int64_t B = q.dim(0), sq = q.dim(1), H = q.dim(2), d = q.dim(3), sk = k.dim(1);
  const T scale = scale_of<T>(opt, d);
  // One (batch, head) per task: its key blocks run in order, so dq's sums have a fixed order.
  auto head = [&](std::int64_t bh) {
    const std::int64_t b = bh / H, h = bh % H;
    const T* lse_row = lse.data() + (b * H + h) * sq;
    // D_i = rowsum(dO_i * O_i): the softmax backward's correction term.
    Eigen::Array<T, Eigen::Dynamic, 1> D(sq);
    {
      const auto O = rows_of(o, b, h, 0, sq);
      const auto dO = rows_of(d_o, b, h, 0, sq);
      for (std::int64_t i = 0; i < sq; ++i)
        D(i) = O.row(i).dot(dO.row(i));
    }
    Matrix<T> dQ = Matrix<T>::Zero(sq, d);
    Matrix<T> s, dp;
    for (std::int64_t j0 = 0; j0 < sk; j0 += kKeyBlock) {
      const std::int64_t cols = std::min(kKeyBlock, sk - j0);
      const auto K = rows_of(k, b, h, j0, cols);
      const auto V = rows_of(v, b, h, j0, cols);
      Matrix<T> dK = Matrix<T>::Zero(cols, d), dV = Matrix<T>::Zero(cols, d);
      // The first query row that sees key j0.
      std::int64_t first = 0;
      if (opt.causal) first = std::clamp<std::int64_t>(opt.k_offset + j0 - opt.q_offset, 0, sq);
      for (std::int64_t i0 = first; i0 < sq; i0 += kQueryBlock) {
        const std::int64_t rows = std::min(kQueryBlock, sq - i0);
        const auto Q = rows_of(q, b, h, i0, rows);
        const auto dO = rows_of(d_o, b, h, i0, rows);
        s.noalias() = scale * Q * K.transpose();
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int64_t seen = visible_keys(opt, i0 + i, sk) - j0;
          const T l = lse_row[i0 + i];
          for (std::int64_t j = 0; j < cols; ++j)
            s(i, j) =
                j < seen && l != -std::numeric_limits<T>::infinity() ? std::exp(s(i, j) - l) : T(0);
        }
        dV.noalias() += s.transpose() * dO;
        dp.noalias() = dO * V.transpose();
        for (std::int64_t i = 0; i < rows; ++i)
          dp.row(i) = (s.row(i).array() * (dp.row(i).array() - D(i0 + i))).matrix();
        dQ.middleRows(i0, rows).noalias() += scale * dp * K;
        dK.noalias() += scale * dp.transpose() * Q;
      }
      mutable_rows_of(dk, b, h, j0, cols) += dK;
      mutable_rows_of(dv, b, h, j0, cols) += dV;
    }
    mutable_rows_of(dq, b, h, 0, sq) = dQ;
  };
  rt::parallel_for(std::int64_t{0}, B * H, head);
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
