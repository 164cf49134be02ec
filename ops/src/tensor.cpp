#include "weave/ops/tensor.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <utility>

#include "weave/devices/device.hpp"

namespace weave::ops {
namespace {

constexpr std::size_t kAlignment = 64;

std::size_t padded_bytes(std::int64_t numel, std::size_t element) {
  // At least one cache line, so an empty tensor still has an address of its own.
  const std::size_t bytes = std::max<std::size_t>(static_cast<std::size_t>(numel) * element, 1);
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

template <typename T>
typename BasicTensor<T>::Strides row_major_strides(const Shape& shape) {
  typename BasicTensor<T>::Strides s{};
  std::int64_t step = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    s[i] = step;
    step *= shape[i];
  }
  return s;
}

}  // namespace

void check_shape(std::string_view what, const Shape& got, const Shape& want) {
  if (!(got == want))
    throw std::invalid_argument(
        fmt::format("{} has shape {}, expected {}", what, got.str(), want.str()));
}

template <typename T>
void check_rows(std::string_view what, const BasicTensor<T>& t) {
  if (!t.defined() || t.rank() < 1)
    throw std::invalid_argument(
        fmt::format("{} must be a tensor of rank >= 1, got shape {}", what, t.shape().str()));
  if (t.dim(-1) > 1 && t.stride(-1) != 1)
    throw std::invalid_argument(
        fmt::format("{} (shape {}) must be contiguous in its last dimension; copy it with clone()",
                    what, t.shape().str()));
}

template <typename T>
BasicTensor<T> BasicTensor<T>::empty(const Shape& shape) {
  const std::size_t bytes = padded_bytes(shape.numel(), sizeof(T));
  void* p = std::aligned_alloc(kAlignment, bytes);
  if (!p) throw std::bad_alloc();
  BasicTensor t;
  t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  t.data_ = static_cast<T*>(p);
  t.shape_ = shape;
  t.strides_ = row_major_strides<T>(shape);
  return t;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::empty(const Shape& shape, devices::Device& device,
                                     rt::MemoryCategory category) {
  const std::size_t bytes = padded_bytes(shape.numel(), sizeof(T));
  void* p = device.allocate(bytes, category);
  BasicTensor t;
  t.storage_ = std::shared_ptr<void>(
      p, [&device, bytes, category](void* q) { device.deallocate(q, bytes, category); });
  t.data_ = static_cast<T*>(p);
  t.shape_ = shape;
  t.strides_ = row_major_strides<T>(shape);
  return t;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::zeros(const Shape& shape) {
  BasicTensor t = empty(shape);
  std::fill_n(t.data_, shape.numel(), T(0));
  return t;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::zeros(const Shape& shape, devices::Device& device,
                                     rt::MemoryCategory category) {
  BasicTensor t = empty(shape, device, category);
  std::fill_n(t.data_, shape.numel(), T(0));
  return t;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::from(std::span<const T> values, const Shape& shape) {
  if (static_cast<std::int64_t>(values.size()) != shape.numel())
    throw std::invalid_argument(fmt::format("{} values cannot fill a tensor of shape {} ({})",
                                            values.size(), shape.str(), shape.numel()));
  BasicTensor t = empty(shape);
  std::copy(values.begin(), values.end(), t.data_);
  return t;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::shape_only(const Shape& shape) {
  BasicTensor t;
  t.storage_ = std::make_shared<char>(0);  // defined, with nothing behind it
  t.shape_ = shape;
  t.strides_ = row_major_strides<T>(shape);
  return t;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::shape_only(const Shape& shape, devices::Device& device,
                                          rt::MemoryCategory category) {
  return shape_only(shape, device, category, sizeof(T));
}

template <typename T>
BasicTensor<T> BasicTensor<T>::shape_only(const Shape& shape, devices::Device& device,
                                          rt::MemoryCategory category, std::size_t element_bytes) {
  const std::size_t bytes = padded_bytes(shape.numel(), element_bytes);
  device.reserve(bytes, category);
  BasicTensor t;
  t.storage_ = std::shared_ptr<void>(new char(0), [&device, bytes, category](void* q) {
    device.unreserve(bytes, category);
    delete static_cast<char*>(q);
  });
  t.shape_ = shape;
  t.strides_ = row_major_strides<T>(shape);
  return t;
}

template <typename T>
std::int64_t BasicTensor<T>::stride(int i) const {
  const int a = i < 0 ? i + rank() : i;
  if (a < 0 || a >= rank())
    throw std::out_of_range(fmt::format("dimension {} of a tensor of shape {}", i, shape_.str()));
  return strides_[a];
}

template <typename T>
bool BasicTensor<T>::is_contiguous() const {
  std::int64_t step = 1;
  for (int i = rank() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != step) return false;
    step *= shape_[i];
  }
  return true;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::slice(int dim, std::int64_t start, std::int64_t length) const {
  const int a = dim < 0 ? dim + rank() : dim;
  if (a < 0 || a >= rank())
    throw std::out_of_range(
        fmt::format("cannot slice dimension {} of a tensor of shape {}", dim, shape_.str()));
  if (start < 0 || length < 0 || start + length > shape_[a])
    throw std::out_of_range(
        fmt::format("slice [{}, {}) of dimension {} is outside the tensor's shape {}", start,
                    start + length, a, shape_.str()));
  BasicTensor v = *this;
  v.data_ = data_ ? data_ + start * strides_[a] : nullptr;
  v.shape_ = shape_.with(a, length);
  return v;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::transpose(int a, int b) const {
  const int x = a < 0 ? a + rank() : a, y = b < 0 ? b + rank() : b;
  if (x < 0 || x >= rank() || y < 0 || y >= rank())
    throw std::out_of_range(fmt::format("cannot swap dimensions {} and {} of a tensor of shape {}",
                                        a, b, shape_.str()));
  BasicTensor v = *this;
  std::swap(v.strides_[x], v.strides_[y]);
  v.shape_ = shape_.with(x, shape_[y]).with(y, shape_[x]);
  return v;
}

template <typename T>
BasicTensor<T> BasicTensor<T>::reshape(const Shape& shape) const {
  if (shape.numel() != numel())
    throw std::invalid_argument(fmt::format("cannot reshape {} ({} elements) to {} ({} elements)",
                                            shape_.str(), numel(), shape.str(), shape.numel()));
  if (!is_contiguous())
    throw std::invalid_argument(fmt::format(
        "cannot reshape a non-contiguous view of shape {}; clone() it first", shape_.str()));
  BasicTensor v = *this;
  v.shape_ = shape;
  v.strides_ = row_major_strides<T>(shape);
  return v;
}

template <typename T>
std::int64_t BasicTensor<T>::rows() const {
  return rank() == 0 ? 0 : (shape_[-1] == 0 ? 0 : numel() / shape_[-1]);
}

template <typename T>
T* BasicTensor<T>::row(std::int64_t r) const {
  std::int64_t offset = 0;
  for (int i = rank() - 2; i >= 0; --i) {
    offset += (r % shape_[i]) * strides_[i];
    r /= shape_[i];
  }
  return data_ + offset;
}

template <typename T>
void BasicTensor<T>::copy_from(const BasicTensor& source) const {
  check_shape("copy source", source.shape(), shape_);
  if (rank() == 0) return;
  const std::int64_t cols = shape_[-1];
  for (std::int64_t r = 0, n = rows(); r < n; ++r) {
    const T* from = source.row(r);
    T* to = row(r);
    if (strides_[rank() - 1] == 1 && source.strides_[rank() - 1] == 1) {
      std::copy_n(from, cols, to);
    } else {
      for (std::int64_t c = 0; c < cols; ++c)
        to[c * strides_[rank() - 1]] = from[c * source.strides_[rank() - 1]];
    }
  }
}

template <typename T>
BasicTensor<T> BasicTensor<T>::clone() const {
  BasicTensor c = empty(shape_);
  c.copy_from(*this);
  return c;
}

template <typename T>
void BasicTensor<T>::fill(T value) const {
  if (rank() == 0) return;
  const std::int64_t cols = shape_[-1], step = strides_[rank() - 1];
  for (std::int64_t r = 0, n = rows(); r < n; ++r) {
    T* to = row(r);
    for (std::int64_t c = 0; c < cols; ++c)
      to[c * step] = value;
  }
}

template <typename T>
std::vector<T> BasicTensor<T>::to_vector() const {
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(numel()));
  if (rank() == 0) return out;
  const std::int64_t cols = shape_[-1], step = strides_[rank() - 1];
  for (std::int64_t r = 0, n = rows(); r < n; ++r) {
    const T* from = row(r);
    for (std::int64_t c = 0; c < cols; ++c)
      out.push_back(from[c * step]);
  }
  return out;
}

template class BasicTensor<float>;
template class BasicTensor<double>;
template class BasicTensor<bf16>;
template class BasicTensor<fp16>;
template void check_rows(std::string_view, const BasicTensor<float>&);
template void check_rows(std::string_view, const BasicTensor<double>&);
template void check_rows(std::string_view, const BasicTensor<bf16>&);
template void check_rows(std::string_view, const BasicTensor<fp16>&);

}  // namespace weave::ops
