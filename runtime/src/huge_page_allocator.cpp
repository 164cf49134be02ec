#include "weave/runtime/huge_page_allocator.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <mutex>
#include <new>

namespace weave::rt::detail {

namespace {
constexpr std::size_t kHugePage = std::size_t{2} << 20;

std::size_t mapped_size(std::size_t bytes) {
  return (bytes + kHugePage - 1) / kHugePage * kHugePage;
}

// Mappings freed lately, kept for the next graph: a program that builds graphs one after
// another (a search over plans, a benchmark) then reuses memory whose pages are already
// faulted in instead of having the kernel zero fresh ones. Bounded, so that a program that
// built one large graph holds at most kKeptBytes it does not use.
constexpr std::size_t kKeptBytes = std::size_t{64} << 20;
constexpr std::size_t kKeptMappings = 16;

struct KeptMappings {
  std::mutex mutex;
  struct Mapping {
    void* p;
    std::size_t size;
  };
  Mapping kept[kKeptMappings];
  std::size_t count = 0;
  std::size_t bytes = 0;

  // A kept mapping of exactly `size` bytes (deallocate knows a mapping's size from the array's
  // capacity only, so a mapping is reused for arrays of its own size; arrays grown by doubling
  // ask for the same sizes graph after graph).
  void* take(std::size_t size) {
    std::lock_guard lock(mutex);
    std::size_t best = count;
    for (std::size_t i = 0; i < count && best == count; ++i) {
      if (kept[i].size == size) best = i;
    }
    if (best == count) return nullptr;
    void* p = kept[best].p;
    bytes -= kept[best].size;
    kept[best] = kept[--count];
    return p;
  }
  bool keep(void* p, std::size_t size) {
    std::lock_guard lock(mutex);
    if (count == kKeptMappings || bytes + size > kKeptBytes) return false;
    kept[count++] = {p, size};
    bytes += size;
    return true;
  }
};

KeptMappings& kept_mappings() {
  static KeptMappings* const kept = new KeptMappings;  // never destroyed: used at exit
  return *kept;
}
}  // namespace

// Maps one huge page more than needed and unmaps the ends that are not 2 MiB-aligned, so that
// the array starts on a huge-page boundary (the kernel backs only aligned 2 MiB ranges with huge
// pages).
void* allocate_huge(std::size_t bytes) {
  const std::size_t size = mapped_size(bytes);
  if (void* p = kept_mappings().take(size)) return p;
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
  const std::size_t size = mapped_size(bytes);
  if (!kept_mappings().keep(p, size)) munmap(p, size);
}

}  // namespace weave::rt::detail
