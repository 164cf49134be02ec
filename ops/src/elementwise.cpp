#include "weave/ops/elementwise.hpp"

#include "parallel_rows.hpp"

namespace weave::ops {

using detail::for_row_blocks;

template <typename T>
void add(const BasicTensor<T>& a, const BasicTensor<T>& b, const BasicTensor<T>& y) {
  check_rows("add input", a);
  check_rows("add input", b);
  check_rows("add output", y);
  check_shape("add's second input", b.shape(), a.shape());
  check_shape("add output", y.shape(), a.shape());
  const std::int64_t n = a.dim(-1);
  for_row_blocks(a.rows(), 256, 1.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* ar = a.row(r);
      const T* br = b.row(r);
      T* yr = y.row(r);
      for (std::int64_t i = 0; i < n; ++i)
        yr[i] = ar[i] + br[i];
    }
  });
}

template <typename T>
void accumulate(const BasicTensor<T>& x, const BasicTensor<T>& into, T scale) {
  check_rows("accumulate source", x);
  check_rows("accumulate target", into);
  check_shape("accumulate target", into.shape(), x.shape());
  const std::int64_t n = x.dim(-1);
  for_row_blocks(x.rows(), 256, 1.0 * n, [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const T* xr = x.row(r);
      T* yr = into.row(r);
      for (std::int64_t i = 0; i < n; ++i)
        yr[i] += scale * xr[i];
    }
  });
}

template void add(const BasicTensor<float>&, const BasicTensor<float>&, const BasicTensor<float>&);
template void add(const BasicTensor<double>&, const BasicTensor<double>&,
                  const BasicTensor<double>&);
template void accumulate(const BasicTensor<float>&, const BasicTensor<float>&, float);
template void accumulate(const BasicTensor<double>&, const BasicTensor<double>&, double);

}  // namespace weave::ops
