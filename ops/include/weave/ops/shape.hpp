// The extents of a tensor: up to four dimensions, row-major.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace weave::ops {

inline constexpr int kMaxRank = 4;

class Shape {
 public:
  Shape() = default;
  // Throws std::invalid_argument for more than kMaxRank dimensions or a negative extent.
  Shape(std::initializer_list<std::int64_t> dims);

  int rank() const { return rank_; }
  // Dimension i; negative i counts from the end (-1 is the last). Throws std::out_of_range.
  std::int64_t operator[](int i) const;
  std::int64_t numel() const;
  const std::int64_t* begin() const { return dims_.data(); }
  const std::int64_t* end() const { return dims_.data() + rank_; }

  // The same shape with dimension i set to `extent`.
  Shape with(int i, std::int64_t extent) const;

  bool operator==(const Shape& other) const;
  // "[2, 3, 4]"
  std::string str() const;

 private:
  int axis(int i) const;
  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

}  // namespace weave::ops
