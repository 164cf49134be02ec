#include "weave/ops/attention.hpp"

#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "weave/ops/gemm_bf16.hpp"
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

// ---- bf16 ----
//
// The same attention with bf16 q, k, v, o: the two forward products (scores Q K^T, context P V)
// and the five backward ones are gemm_bf16 products (bf16 values, fp32 sums); the softmax, the
// log-sum-exp and D = rowsum(dO * O) run in fp32, and P and dS are rounded to bf16 only as
// operands of the products that follow them, as flash-attention does with 16-bit inputs. Queries
// go in chunks of kBf16QueryChunk rows against all the keys they see at once: products large
// enough for oneDNN's kernels, an fp32 score block of chunk x keys per task.

namespace {

constexpr std::int64_t kBf16QueryChunk = 128;

// Head `head` of group g of batch entry b, rows [first, first + count), of a [b, s, g, n d]
// tensor, as a matrix view (d columns, the sequence stride between rows).
template <typename T>
MatrixView<T> head_rows(const BasicTensor<T>& t, std::int64_t b, std::int64_t g, std::int64_t head,
                        std::int64_t d, std::int64_t first, std::int64_t count) {
  return {t.data() + b * t.stride(0) + first * t.stride(1) + g * t.stride(2) + head * d, count, d,
          t.stride(1)};
}
template <typename T>
MatrixView<const T> const_view(MatrixView<T> m) {
  return {m.data, m.rows, m.cols, m.stride};
}

// A 16-bit kernel's fp32 scores, on whose rows Eigen's vectorised exp and sum run. Eigen starts
// such a loop at the first packet-aligned element and takes the elements before it one at a
// time (std::exp, a plain sum), whose bits differ from the packet ones: the result depends on
// where the buffer starts. std::vector's storage is only 16-byte aligned, at an address that
// varies with what the heap holds (which tasks ran alongside), so a run would not be bitwise
// repeatable. Aligned to Eigen's largest packet, every row starts where it did in any other run,
// as the fp32 kernel's Eigen matrices and ops' tensors do.
using Scores = std::vector<float, Eigen::aligned_allocator<float>>;

// The matrix with dense rows: itself, or a copy in `buffer`. A head's rows in a [b, s, h, d]
// tensor are h d apart, and oneDNN's AMX and AVX512_BF16 matmuls (brgemm) take only dense rows;
// its fallback for strided ones runs several times slower than the copy costs.
template <typename Half>
MatrixView<const Half> dense(MatrixView<const Half> m, std::vector<Half>& buffer) {
  if (m.stride == m.cols) return m;
  buffer.resize(static_cast<std::size_t>(m.rows * m.cols));
  for (std::int64_t r = 0; r < m.rows; ++r)
    std::copy_n(m.data + r * m.stride, m.cols, buffer.data() + r * m.cols);
  return {buffer.data(), m.rows, m.cols, m.cols};
}

template <typename Half>
void check_attention_half(const AttentionOptions& opt, const BasicTensor<Half>& q,
                          const BasicTensor<Half>& k, const BasicTensor<Half>& v,
                          const BasicTensor<Half>& o, const Tensor& lse) {
  // The shape rules are the fp32 kernel's: checked on shape-only stand-ins.
  auto like = [](const BasicTensor<Half>& t) {
    check_rows("attention tensor", t);
    return Tensor::shape_only(t.shape());
  };
  check_attention<float>(opt, like(q), like(k), like(v), like(o), lse);
}

template <typename Half>
void attention_forward_half(const AttentionOptions& opt, const BasicTensor<Half>& q,
                            const BasicTensor<Half>& k, const BasicTensor<Half>& v,
                            const BasicTensor<Half>& o, const Tensor& lse) {
  check_attention_half(opt, q, k, v, o, lse);
  const std::int64_t n = q.dim(3) / k.dim(3);
  const std::int64_t B = q.dim(0), sq = q.dim(1), H = q.dim(2) * n, d = k.dim(3), sk = k.dim(1);
  const float scale = scale_of<float>(opt, d);
  const std::int64_t chunks = (sq + kBf16QueryChunk - 1) / kBf16QueryChunk;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const DropoutMask<float> mask(opt);
  auto chunk = [&](std::int64_t index) {
    const std::int64_t c = index % chunks, bh = index / chunks;
    const std::int64_t b = bh / H, h = bh % H, g = h / n, head = h % n;
    const std::int64_t i0 = c * kBf16QueryChunk, rows = std::min(kBf16QueryChunk, sq - i0);
    const std::int64_t keys = visible_keys(opt, i0 + rows - 1, sk);
    const auto out = head_rows(o, b, g, head, d, i0, rows);
    float* lse_row = lse.data() + (b * H + h) * sq + i0;
    std::vector<float> ctx(static_cast<std::size_t>(rows * d), 0.f);
    Scores s(static_cast<std::size_t>(rows * keys));
    std::vector<Half> p(s.size());
    std::vector<float> l(static_cast<std::size_t>(rows), 0.f), keep(static_cast<std::size_t>(keys));
    std::vector<Half> q_rows, k_rows, v_rows;
    if (keys > 0) {
      gemm_half(Transpose::no, Transpose::yes, scale,
                dense(const_view(head_rows(q, b, g, head, d, i0, rows)), q_rows),
                dense(const_view(head_rows(k, b, g, 0, d, 0, keys)), k_rows), 0.f,
                MatrixView<float>{s.data(), rows, keys, keys});
    }
    for (std::int64_t i = 0; i < rows; ++i) {
      float* si = s.data() + i * keys;
      Half* pi = p.data() + i * keys;
      const std::int64_t seen = visible_keys(opt, i0 + i, sk);
      // Eigen's vectorised exp over the keys the row sees; the rest are masked to 0.
      Eigen::Map<Eigen::ArrayXf> row(si, seen);
      const float m = seen > 0 ? row.maxCoeff() : kNegInf;
      if (seen > 0) row = (row - m).exp();
      std::fill(si + seen, si + keys, 0.f);
      const float sum = seen > 0 ? row.sum() : 0.f;
      l[static_cast<std::size_t>(i)] = sum;
      lse_row[i] = seen > 0 ? m + std::log(sum) : kNegInf;
      // The normaliser sums every probability; only the context sees the dropped ones go.
      if (mask.active() && seen > 0) {
        mask.row(b, h, i0 + i, 0, seen, keep.data());
        for (std::int64_t j = 0; j < seen; ++j)
          si[j] *= keep[static_cast<std::size_t>(j)];
      }
      for (std::int64_t j = 0; j < keys; ++j)
        pi[j] = Half(si[j]);
    }
    if (keys > 0) {
      gemm_half(Transpose::no, Transpose::no, 1.f,
                MatrixView<const Half>{p.data(), rows, keys, keys},
                dense(const_view(head_rows(v, b, g, 0, d, 0, keys)), v_rows), 0.f,
                MatrixView<float>{ctx.data(), rows, d, d});
    }
    for (std::int64_t i = 0; i < rows; ++i) {
      const float li = l[static_cast<std::size_t>(i)];
      for (std::int64_t c2 = 0; c2 < d; ++c2)
        out.data[i * out.stride + c2] =
            Half(li > 0.f ? ctx[static_cast<std::size_t>(i * d + c2)] / li : 0.f);
    }
  };
  rt::parallel_for(std::int64_t{0}, B * H * chunks, chunk);
}

template <typename Half>
void attention_backward_half(const AttentionOptions& opt, const BasicTensor<Half>& q,
                             const BasicTensor<Half>& k, const BasicTensor<Half>& v,
                             const BasicTensor<Half>& o, const Tensor& lse,
                             const BasicTensor<Half>& d_o, const BasicTensor<Half>& dq,
                             const Tensor& dk, const Tensor& dv) {
  check_attention_half(opt, q, k, v, o, lse);
  check_rows("attention output gradient", d_o);
  check_rows("attention query gradient", dq);
  check_bshd("key gradient", dk);
  check_bshd("value gradient", dv);
  check_shape("attention output gradient", d_o.shape(), q.shape());
  check_shape("attention query gradient", dq.shape(), q.shape());
  check_shape("attention key gradient", dk.shape(), k.shape());
  check_shape("attention value gradient", dv.shape(), v.shape());
  const std::int64_t n = q.dim(3) / k.dim(3);
  const std::int64_t B = q.dim(0), sq = q.dim(1), G = q.dim(2), H = G * n, d = k.dim(3);
  const std::int64_t sk = k.dim(1);
  const float scale = scale_of<float>(opt, d);
  const DropoutMask<float> mask(opt);
  // One (batch, key/value head) per task, its query heads and chunks in order: dK and dV, shared
  // by the group's query heads, are summed in a fixed order.
  auto group = [&](std::int64_t bg) {
    const std::int64_t b = bg / G, g = bg % G;
    Scores s;
    std::vector<float> dp, keep;
    std::vector<Half> p, ds, k_rows, v_rows, q_rows, do_rows, dq_rows;
    // The group's keys and values with dense rows, and its key and value gradients summed
    // densely before they are added to dk and dv.
    const auto K_all = dense(const_view(head_rows(k, b, g, 0, d, 0, sk)), k_rows);
    const auto V_all = dense(const_view(head_rows(v, b, g, 0, d, 0, sk)), v_rows);
    std::vector<float> dk_sum(static_cast<std::size_t>(sk * d), 0.f), dv_sum(dk_sum.size(), 0.f);
    for (std::int64_t head = 0; head < n; ++head) {
      const std::int64_t h = g * n + head;
      const float* lse_row = lse.data() + (b * H + h) * sq;
      for (std::int64_t i0 = 0; i0 < sq; i0 += kBf16QueryChunk) {
        const std::int64_t rows = std::min(kBf16QueryChunk, sq - i0);
        const std::int64_t keys = visible_keys(opt, i0 + rows - 1, sk);
        const auto Q = dense(const_view(head_rows(q, b, g, head, d, i0, rows)), q_rows);
        const auto dO = dense(const_view(head_rows(d_o, b, g, head, d, i0, rows)), do_rows);
        const auto O = const_view(head_rows(o, b, g, head, d, i0, rows));
        const auto dQ = head_rows(dq, b, g, head, d, i0, rows);
        if (keys == 0) {
          for (std::int64_t i = 0; i < rows; ++i)
            std::fill_n(dQ.data + i * dQ.stride, d, Half(0.f));
          continue;
        }
        const MatrixView<const Half> K{K_all.data, keys, d, K_all.stride};
        const MatrixView<const Half> V{V_all.data, keys, d, V_all.stride};
        s.assign(static_cast<std::size_t>(rows * keys), 0.f);
        dp.assign(s.size(), 0.f);
        p.resize(s.size());
        ds.resize(s.size());
        keep.resize(static_cast<std::size_t>(keys));
        gemm_half(Transpose::no, Transpose::yes, scale, Q, K, 0.f,
                  MatrixView<float>{s.data(), rows, keys, keys});
        gemm_half(Transpose::no, Transpose::yes, 1.f, dO, V, 0.f,
                  MatrixView<float>{dp.data(), rows, keys, keys});
        for (std::int64_t i = 0; i < rows; ++i) {
          // D_i = rowsum(dO_i * O_i) in fp32: the softmax backward's correction term.
          float D = 0;
          for (std::int64_t c = 0; c < d; ++c)
            D += static_cast<float>(dO.data[i * dO.stride + c]) *
                 static_cast<float>(O.data[i * O.stride + c]);
          const std::int64_t seen = visible_keys(opt, i0 + i, sk);
          const float l = lse_row[i0 + i];
          float* si = s.data() + i * keys;
          float* dpi = dp.data() + i * keys;
          // P from the saved lse, over the keys the row sees (none if it sees none).
          const std::int64_t sees =
              l == -std::numeric_limits<float>::infinity() ? std::int64_t{0} : seen;
          Eigen::Map<Eigen::ArrayXf> row(si, sees);
          row = (row - l).exp();
          std::fill(si + sees, si + keys, 0.f);
          if (mask.active() && sees > 0) mask.row(b, h, i0 + i, 0, sees, keep.data());
          for (std::int64_t j = 0; j < keys; ++j) {
            const float pj = si[j];
            const float kj = mask.active() && j < sees ? keep[static_cast<std::size_t>(j)] : 1.f;
            // P's dropped form feeds V's gradient; the mask scales dP the same way.
            p[static_cast<std::size_t>(i * keys + j)] = Half(pj * kj);
            ds[static_cast<std::size_t>(i * keys + j)] = Half(pj * (dpi[j] * kj - D));
          }
        }
        const MatrixView<const Half> P{p.data(), rows, keys, keys};
        const MatrixView<const Half> dS{ds.data(), rows, keys, keys};
        gemm_half(Transpose::yes, Transpose::no, 1.f, P, dO, 1.f,
                  MatrixView<float>{dv_sum.data(), keys, d, d});
        gemm_half(Transpose::yes, Transpose::no, scale, dS, Q, 1.f,
                  MatrixView<float>{dk_sum.data(), keys, d, d});
        dq_rows.resize(static_cast<std::size_t>(rows * d));
        gemm_half(Transpose::no, Transpose::no, scale, dS, K, 0.f,
                  MatrixView<Half>{dq_rows.data(), rows, d, d});
        for (std::int64_t i = 0; i < rows; ++i)
          std::copy_n(dq_rows.data() + i * d, d, dQ.data + i * dQ.stride);
      }
    }
    const auto dK = head_rows(dk, b, g, 0, d, 0, sk), dV = head_rows(dv, b, g, 0, d, 0, sk);
    for (std::int64_t j = 0; j < sk; ++j)
      for (std::int64_t c = 0; c < d; ++c) {
        dK.data[j * dK.stride + c] += dk_sum[static_cast<std::size_t>(j * d + c)];
        dV.data[j * dV.stride + c] += dv_sum[static_cast<std::size_t>(j * d + c)];
      }
  };
  rt::parallel_for(std::int64_t{0}, B * G, group);
}

}  // namespace

void attention_forward(const AttentionOptions& opt, const Bf16Tensor& q, const Bf16Tensor& k,
                       const Bf16Tensor& v, const Bf16Tensor& o, const Tensor& lse) {
  attention_forward_half(opt, q, k, v, o, lse);
}
void attention_forward(const AttentionOptions& opt, const Fp16Tensor& q, const Fp16Tensor& k,
                       const Fp16Tensor& v, const Fp16Tensor& o, const Tensor& lse) {
  attention_forward_half(opt, q, k, v, o, lse);
}
void attention_backward(const AttentionOptions& opt, const Bf16Tensor& q, const Bf16Tensor& k,
                        const Bf16Tensor& v, const Bf16Tensor& o, const Tensor& lse,
                        const Bf16Tensor& d_o, const Bf16Tensor& dq, const Tensor& dk,
                        const Tensor& dv) {
  attention_backward_half(opt, q, k, v, o, lse, d_o, dq, dk, dv);
}
void attention_backward(const AttentionOptions& opt, const Fp16Tensor& q, const Fp16Tensor& k,
                        const Fp16Tensor& v, const Fp16Tensor& o, const Tensor& lse,
                        const Fp16Tensor& d_o, const Fp16Tensor& dq, const Tensor& dk,
                        const Tensor& dv) {
  attention_backward_half(opt, q, k, v, o, lse, d_o, dq, dk, dv);
}

}  // namespace weave::ops
