// A dense tensor of up to four dimensions, row-major, and views of it.
//
// Storage is shared: copies of a tensor and views into it alias the same memory, which lives
// as long as any of them. Storage comes from a device's allocator (NUMA-bound, counted by the
// memory tracker under a category) or, for host-side data and tests, from the heap.
// Views keep the strides of their parent, so a slice along the sequence dimension of a
// [batch, sequence, ...] tensor costs nothing; kernels accept any view whose last dimension
// is contiguous.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "weave/ops/bfloat16.hpp"
#include "weave/ops/float16.hpp"
#include "weave/ops/shape.hpp"
#include "weave/runtime/memory_tracker.hpp"

namespace weave::devices {
class Device;
}

namespace weave::ops {

template <typename T>
class BasicTensor {
 public:
  using Strides = std::array<std::int64_t, kMaxRank>;

  // An empty tensor (rank 0, no storage).
  BasicTensor() = default;

  // Uninitialised storage on the heap.
  static BasicTensor empty(const Shape& shape);
  // Uninitialised storage from `device`'s allocator, counted under `category`.
  static BasicTensor empty(const Shape& shape, devices::Device& device,
                           rt::MemoryCategory category);
  static BasicTensor zeros(const Shape& shape);
  static BasicTensor zeros(const Shape& shape, devices::Device& device,
                           rt::MemoryCategory category);
  // A heap tensor holding `values` (values.size() must equal shape.numel()).
  static BasicTensor from(std::span<const T> values, const Shape& shape);
  // A tensor with a shape and no storage, for graphs built to be replayed without running their
  // work (a prediction at scale): defined, but data() is null, as are its views' (whose shapes
  // and strides are what a real tensor's would be). With a device, its memory tracker counts
  // the bytes the tensor would hold under `category` while it lives; nothing is allocated.
  static BasicTensor shape_only(const Shape& shape);
  static BasicTensor shape_only(const Shape& shape, devices::Device& device,
                                rt::MemoryCategory category);
  // The same, counting `element_bytes` per element: what the tensor would hold in another
  // precision (a 16-bit activation: 2).
  static BasicTensor shape_only(const Shape& shape, devices::Device& device,
                                rt::MemoryCategory category, std::size_t element_bytes);

  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  std::int64_t dim(int i) const { return shape_[i]; }
  std::int64_t numel() const { return shape_.numel(); }
  std::int64_t stride(int i) const;
  bool defined() const { return storage_ != nullptr; }
  // Elements laid out densely in row-major order, with no gaps.
  bool is_contiguous() const;

  T* data() const { return data_; }
  // False for a shape_only tensor (and its views).
  bool has_storage() const { return data_ != nullptr; }
  // The element at the given indices (as many as the rank). Unchecked.
  T& operator()(std::int64_t i) const { return data_[i * strides_[0]]; }
  T& operator()(std::int64_t i, std::int64_t j) const {
    return data_[i * strides_[0] + j * strides_[1]];
  }
  T& operator()(std::int64_t i, std::int64_t j, std::int64_t k) const {
    return data_[i * strides_[0] + j * strides_[1] + k * strides_[2]];
  }
  T& operator()(std::int64_t i, std::int64_t j, std::int64_t k, std::int64_t l) const {
    return data_[i * strides_[0] + j * strides_[1] + k * strides_[2] + l * strides_[3]];
  }

  // A view of `length` entries from `start` along dimension `dim`, sharing storage.
  BasicTensor slice(int dim, std::int64_t start, std::int64_t length) const;
  // A view with dimensions a and b swapped (a [s, b, ...] activation seen as [b, s, ...]).
  BasicTensor transpose(int a, int b) const;
  // A view with another shape of the same element count. Requires a contiguous tensor.
  BasicTensor reshape(const Shape& shape) const;
  // A contiguous heap copy.
  BasicTensor clone() const;
  // Copies `source` (same shape) into this tensor's elements.
  void copy_from(const BasicTensor& source) const;
  void fill(T value) const;
  // The elements in row-major order.
  std::vector<T> to_vector() const;

  // Rows of the last dimension: the tensor as numel / dim(-1) rows. Row r's address follows
  // the strides, so it works for views. Requires stride(-1) == 1.
  std::int64_t rows() const;
  T* row(std::int64_t r) const;
  // The same storage, shape and strides with its elements' bits read as U, a type of T's size:
  // a 16-bit run holds its 16-bit tensors as Bf16Tensor storage, which an fp16 run reads as
  // fp16.
  template <typename U>
  BasicTensor<U> bits_as() const {
    static_assert(sizeof(U) == sizeof(T) && alignof(U) == alignof(T));
    BasicTensor<U> out;
    out.storage_ = storage_;
    out.data_ = reinterpret_cast<U*>(data_);
    out.shape_ = shape_;
    out.strides_ = strides_;
    return out;
  }

 private:
  template <typename>
  friend class BasicTensor;
  std::shared_ptr<void> storage_;
  T* data_ = nullptr;
  Shape shape_;
  Strides strides_{};
};

using Tensor = BasicTensor<float>;
// 16-bit storage of parameters and activations (issue 24's bf16 training).
using Bf16Tensor = BasicTensor<bf16>;
using Fp16Tensor = BasicTensor<fp16>;

extern template class BasicTensor<float>;
extern template class BasicTensor<double>;
extern template class BasicTensor<bf16>;
extern template class BasicTensor<fp16>;

// Throws std::invalid_argument unless `got` equals `want`, naming both shapes and `what`
// (e.g. "layer_norm weight").
void check_shape(std::string_view what, const Shape& got, const Shape& want);
// Throws std::invalid_argument unless the tensor is at least rank 1 with a contiguous last
// dimension.
template <typename T>
void check_rows(std::string_view what, const BasicTensor<T>& t);

}  // namespace weave::ops
