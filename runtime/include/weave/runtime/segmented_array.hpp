// An array that grows without moving its elements, for the per-task and per-edge rows a graph
// builder appends one at a time.
//
// A std::vector that doubles copies every element it holds each time it grows: building a
// 100,000-task chain spent a third of its time in those copies (perf of bench_runtime's
// BM_WeaveBuild). Here the storage is a list of segments of doubling size (kFirst, 2 kFirst,
// 4 kFirst, ...): growing allocates the next segment and leaves the others where they are, so
// the memory used is within a factor of two of the elements held, as with a vector, and
// element i is found with a bit scan instead of being at data() + i. Segments come from
// HugePageAllocator, so the large ones are backed by 2 MiB pages.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

#include "weave/runtime/huge_page_allocator.hpp"

namespace weave::rt::detail {

template <class T>
class SegmentedArray {
 public:
  // Segment k holds kFirst << k elements, indices [kFirst * (2^k - 1), kFirst * (2^(k+1) - 1)).
  static constexpr unsigned kFirstBits = 6;
  static constexpr std::size_t kFirst = std::size_t{1} << kFirstBits;
  static constexpr unsigned kMaxSegments = 40;

  SegmentedArray() = default;
  SegmentedArray(const SegmentedArray& other) {
    reserve(other.size_);
    for (std::size_t i = 0; i < other.size_; ++i)
      emplace_back(other[i]);
  }
  SegmentedArray(SegmentedArray&& other) noexcept { steal(other); }
  SegmentedArray& operator=(const SegmentedArray& other) {
    if (this != &other) {
      SegmentedArray copy(other);
      *this = std::move(copy);
    }
    return *this;
  }
  SegmentedArray& operator=(SegmentedArray&& other) noexcept {
    if (this != &other) {
      release();
      steal(other);
    }
    return *this;
  }
  ~SegmentedArray() { release(); }

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  T& operator[](std::size_t i) { return *locate(i); }
  const T& operator[](std::size_t i) const { return *locate(i); }
  T& back() { return *locate(size_ - 1); }

  template <class... Args>
  T& emplace_back(Args&&... args) {
    if (next_ == end_) [[unlikely]]
      grow();
    T* p = ::new (static_cast<void*>(next_)) T(std::forward<Args>(args)...);
    ++next_;
    ++size_;
    return *p;
  }
  void push_back(const T& v) { emplace_back(v); }
  void push_back(T&& v) { emplace_back(std::move(v)); }

  // Allocates the segments that `n` elements need; elements stay where they are.
  void reserve(std::size_t n) {
    while (capacity() < n)
      add_segment();
    if (next_ == end_ && size_ < capacity()) point_at(size_);
  }

  // Destroys the elements from `n` on (n <= size()).
  void truncate(std::size_t n) {
    for (std::size_t i = n; i < size_; ++i)
      locate(i)->~T();
    size_ = n;
    if (segments_ != 0) point_at(n);
  }

  // The elements as contiguous runs, in index order: for loops over all of them.
  unsigned segment_count() const { return segments_; }
  std::span<T> segment(unsigned k) { return {segment_[k], segment_used(k)}; }
  std::span<const T> segment(unsigned k) const { return {segment_[k], segment_used(k)}; }

 private:
  static std::size_t segment_size(unsigned k) { return kFirst << k; }
  static std::size_t segment_start(unsigned k) { return kFirst * ((std::size_t{1} << k) - 1); }
  std::size_t capacity() const { return segment_start(segments_); }
  std::size_t segment_used(unsigned k) const {
    const std::size_t start = segment_start(k);
    if (size_ <= start) return 0;
    return size_ - start < segment_size(k) ? size_ - start : segment_size(k);
  }

  T* locate(std::size_t i) const {
    const std::size_t j = i + kFirst;
    const unsigned k = static_cast<unsigned>(std::bit_width(j)) - 1 - kFirstBits;
    return segment_[k] + (j - (kFirst << k));
  }

  // Makes next_/end_ the free room of the segment that holds index n.
  void point_at(std::size_t n) {
    if (n == capacity()) {
      next_ = end_ = nullptr;
      return;
    }
    const std::size_t j = n + kFirst;
    const unsigned k = static_cast<unsigned>(std::bit_width(j)) - 1 - kFirstBits;
    next_ = segment_[k] + (j - (kFirst << k));
    end_ = segment_[k] + segment_size(k);
  }

  void add_segment() {
    if (segments_ == kMaxSegments) throw std::bad_alloc();
    segment_[segments_] = HugePageAllocator<T>().allocate(segment_size(segments_));
    ++segments_;
  }

  void grow() {
    if (size_ == capacity()) add_segment();
    point_at(size_);
  }

  void release() noexcept {
    if constexpr (!std::is_trivially_destructible_v<T>) {
      for (unsigned k = 0; k < segments_; ++k) {
        for (T& v : segment(k))
          v.~T();
      }
    }
    for (unsigned k = 0; k < segments_; ++k)
      HugePageAllocator<T>().deallocate(segment_[k], segment_size(k));
    segments_ = 0;
    size_ = 0;
    next_ = end_ = nullptr;
  }

  void steal(SegmentedArray& other) noexcept {
    for (unsigned k = 0; k < other.segments_; ++k)
      segment_[k] = other.segment_[k];
    segments_ = std::exchange(other.segments_, 0);
    size_ = std::exchange(other.size_, 0);
    next_ = std::exchange(other.next_, nullptr);
    end_ = std::exchange(other.end_, nullptr);
  }

  T* segment_[kMaxSegments];
  unsigned segments_ = 0;
  std::size_t size_ = 0;
  T* next_ = nullptr;  // where the next element goes, in the last segment in use
  T* end_ = nullptr;
};

}  // namespace weave::rt::detail
