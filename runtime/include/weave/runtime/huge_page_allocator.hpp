// An allocator for the large arrays of a graph (its tasks, edges and work), which asks the kernel
// for transparent huge pages where it can.
//
// A graph of a million tasks lives in arrays of tens of megabytes that are written once, front
// to back, as the graph is built. With 4 KiB pages every 4 KiB of them costs a page fault on
// first touch, and the kernel's fault path took about 40 % of the time the benchmark's
// 100,000-task chain took to build (perf, before this allocator). An array of at least
// kHugePageThreshold bytes is mapped on its own, aligned to 2 MiB and marked MADV_HUGEPAGE, so the
// kernel backs it with 2 MiB pages where transparent huge pages are enabled ("always" or
// "madvise"): one fault per 2 MiB. Where they are disabled it is an ordinary mapping. Smaller
// arrays use operator new. Up to 64 MiB of freed mappings are kept for arrays of the same size
// (huge_page_allocator.cpp), so a program that builds graph after graph reuses touched pages.
#pragma once

#include <cstddef>
#include <new>

namespace weave::rt {

namespace detail {
inline constexpr std::size_t kHugePageThreshold = std::size_t{1} << 20;
void* allocate_huge(std::size_t bytes);
void deallocate_huge(void* p, std::size_t bytes) noexcept;
}  // namespace detail

template <class T>
struct HugePageAllocator {
  using value_type = T;
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);

  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes >= detail::kHugePageThreshold) return static_cast<T*>(detail::allocate_huge(bytes));
    return static_cast<T*>(::operator new(bytes));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    const std::size_t bytes = n * sizeof(T);
    if (bytes >= detail::kHugePageThreshold) {
      detail::deallocate_huge(p, bytes);
    } else {
      ::operator delete(p);
    }
  }

  template <class U>
  bool operator==(const HugePageAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace weave::rt
