// Telling ThreadSanitizer about a hand-off between threads that happens inside libtbb.
//
// libtbb is not built with ThreadSanitizer, so when one thread prepares data and a TBB worker
// reads it after an enqueue (or an observer callback), TSan sees no ordering and reports a
// race. The side that hands over calls announce_handoff(p) after preparing the data, the side
// that receives calls accept_handoff(p) before reading it. Without TSan both do nothing.
#pragma once

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace weave::rt {

inline void announce_handoff([[maybe_unused]] const void* token) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(const_cast<void*>(token));
#endif
}

inline void accept_handoff([[maybe_unused]] const void* token) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(const_cast<void*>(token));
#endif
}

}  // namespace weave::rt
