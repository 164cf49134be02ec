// Telling ThreadSanitizer about a hand-off between threads that happens inside libtbb.
//
// libtbb is not built with ThreadSanitizer, so when one thread prepares data and a TBB worker
// reads it after an enqueue (or an observer callback), TSan sees no ordering and reports a
// race. The side that hands over calls announce_handoff(p) after preparing the data, the side
// that receives calls accept_handoff(p) before reading it. Without TSan both do nothing.
#pragma once

#include <utility>

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

// A function object to give to libtbb (task_arena::enqueue, task_arena::execute), which may copy
// it on the submitting thread and call the copy on a worker. Announcing before the submission
// would not cover the copy, made later inside the call: each copy announces itself once it is
// complete, and a call accepts the copy it runs on before reading any of it. A call announces its
// copy again when it returns, for a submitter that waited for it (execute) to accept.
template <typename Function>
class HandedOver {
 public:
  explicit HandedOver(Function function) : function_(std::move(function)) {
    announce_handoff(this);
  }
  HandedOver(const HandedOver& other) : function_((accept_handoff(&other), other.function_)) {
    announce_handoff(this);
  }
  HandedOver(HandedOver&& other) noexcept
      : function_((accept_handoff(&other), std::move(other.function_))) {
    announce_handoff(this);
  }
  HandedOver& operator=(const HandedOver&) = delete;
  HandedOver& operator=(HandedOver&&) = delete;

  template <typename... Args>
  decltype(auto) operator()(Args&&... args) const {
    accept_handoff(this);
    const AnnounceOnReturn announce{this};
    return function_(std::forward<Args>(args)...);
  }

 private:
  struct AnnounceOnReturn {
    const void* token;
    ~AnnounceOnReturn() { announce_handoff(token); }
  };
  Function function_;
};

}  // namespace weave::rt
