#include "weave/runtime/huge_page_allocator.hpp"

#include <sys/mman.h>

#include <cstdint>

namespace weave::rt::detail {

namespace {
constexpr std::size_t kHugePage = std::size_t{2} << 20;

std::size_t mapped_size(std::size_t bytes) {
  return (bytes + kHugePage - 1) / kHugePage * kHugePage;
}
}  // namespace

// Maps one huge page more than needed and unmaps the ends that are not 2 MiB-aligned, so that
// the array starts on a huge-page boundary (the kernel backs only aligned 2 MiB ranges with huge
// pages).
void* allocate_huge(std::size_t bytes) {
  const std::size_t size = mapped_size(bytes);
  void* mapped =
      mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) throw std::bad_alloc();
  const auto begin = reinterpret_cast<std::uintptr_t>(mapped);
  const std::uintptr_t aligned = (begin + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > begin) munmap(mapped, aligned - begin);
  const std::uintptr_t end = begin + size + kHugePage;
  if (end > aligned + size) munmap(reinterpret_cast<void*>(aligned + size), end - aligned - size);
  // Advice only: without transparent huge pages the mapping works with small pages.
  madvise(reinterpret_cast<void*>(aligned), size, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}

void deallocate_huge(void* p, std::size_t bytes) noexcept {
  munmap(p, mapped_size(bytes));
}

}  // namespace weave::rt::detail
