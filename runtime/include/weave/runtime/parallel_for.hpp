// The one way weave's code spreads a loop over the threads of the calling arena.
//
// tbb::parallel_for hands the loop's pieces to the arena's workers and waits for them inside
// libtbb, which is not built with ThreadSanitizer: TSan sees neither the spawn (a worker reads
// what the caller wrote before the loop, and the piece of range and copy of the body another
// thread split off for it) nor the join (the caller reads what the workers wrote). This wrapper
// announces all of them (thread_handoff.hpp), so that a report under TSan is a real race in the
// loop's body, not the hand-off. Without TSan it is tbb::parallel_for over a blocked range of
// grain 1 with the default partitioner.
#pragma once

#include <tbb/parallel_for.h>

#include <type_traits>

#include "weave/runtime/thread_handoff.hpp"

namespace weave::rt {

namespace detail {

// [begin, end), split in halves as tbb::blocked_range is. Every range is made complete, then
// announced; libtbb reads a range only through these members, each of which first accepts it.
// A thread that steals a piece therefore sees what the thread that split it off wrote, back to
// the caller's writes before the loop.
template <typename Index>
class AnnouncedRange {
 public:
  AnnouncedRange(Index begin, Index end) : begin_(begin), end_(end) { announce_handoff(this); }
  AnnouncedRange(const AnnouncedRange& other) {
    accept_handoff(&other);
    begin_ = other.begin_;
    end_ = other.end_;
    announce_handoff(this);
  }
  // The splitting constructor: takes the upper half of `other`, which keeps the lower half.
  AnnouncedRange(AnnouncedRange& other, tbb::split) {
    accept_handoff(&other);
    const Index middle = other.begin_ + (other.end_ - other.begin_) / 2;
    begin_ = middle;
    end_ = other.end_;
    other.end_ = middle;
    announce_handoff(this);
    announce_handoff(&other);
  }
  AnnouncedRange& operator=(const AnnouncedRange&) = delete;

  bool empty() const {
    accept_handoff(this);
    return !(begin_ < end_);
  }
  bool is_divisible() const {
    accept_handoff(this);
    return end_ - begin_ > 1;
  }
  Index begin() const {
    accept_handoff(this);
    return begin_;
  }
  Index end() const {
    accept_handoff(this);
    return end_;
  }

 private:
  Index begin_{};
  Index end_{};
};

// The loop body as libtbb copies it into every piece: each copy is announced once made and
// accepted before it runs; each piece announces the loop's token when done, for the caller.
template <typename Index, typename Body>
class AnnouncedBody {
 public:
  AnnouncedBody(const Body& body, const void* loop) : body_(&body), loop_(loop) {
    announce_handoff(this);
  }
  AnnouncedBody(const AnnouncedBody& other) {
    accept_handoff(&other);
    body_ = other.body_;
    loop_ = other.loop_;
    announce_handoff(this);
  }
  AnnouncedBody& operator=(const AnnouncedBody&) = delete;

  void operator()(const AnnouncedRange<Index>& range) const {
    accept_handoff(this);
    for (Index i = range.begin(), end = range.end(); i < end; ++i)
      (*body_)(i);
    announce_handoff(loop_);
  }

 private:
  const Body* body_ = nullptr;
  const void* loop_ = nullptr;
};

}  // namespace detail

// Calls body(i) for every i in [first, last), in any order and on any of the arena's threads.
template <typename Index, typename Body>
void parallel_for(Index first, Index last, const Body& body) {
  static_assert(std::is_integral_v<Index>, "parallel_for runs over an integer range");
  // The body lives on the caller's stack for the whole loop: its address names this loop and no
  // other one running at the same time.
  const void* const loop = &body;
  tbb::parallel_for(detail::AnnouncedRange<Index>(first, last),
                    detail::AnnouncedBody<Index, Body>(body, loop));
  accept_handoff(loop);  // what every piece wrote
}

}  // namespace weave::rt
