#include "weave/ops/shape.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

namespace weave::ops {

Shape::Shape(std::initializer_list<std::int64_t> dims) {
  if (dims.size() > kMaxRank)
    throw std::invalid_argument(fmt::format("a tensor has at most {} dimensions, got {}: {}",
                                            kMaxRank, dims.size(), fmt::join(dims, ", ")));
  for (std::int64_t d : dims) {
    if (d < 0)
      throw std::invalid_argument(
          fmt::format("tensor extents must be >= 0, got [{}]", fmt::join(dims, ", ")));
    dims_[rank_++] = d;
  }
}

int Shape::axis(int i) const {
  const int a = i < 0 ? i + rank_ : i;
  if (a < 0 || a >= rank_)
    throw std::out_of_range(
        fmt::format("dimension {} of a shape of rank {} ({})", i, rank_, str()));
  return a;
}

std::int64_t Shape::operator[](int i) const {
  return dims_[axis(i)];
}

std::int64_t Shape::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < rank_; ++i)
    n *= dims_[i];
  return n;
}

Shape Shape::with(int i, std::int64_t extent) const {
  if (extent < 0)
    throw std::invalid_argument(fmt::format("tensor extents must be >= 0, got {}", extent));
  Shape s = *this;
  s.dims_[axis(i)] = extent;
  return s;
}

bool Shape::operator==(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != other.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  return fmt::format("[{}]", fmt::join(begin(), end(), ", "));
}

}  // namespace weave::ops
