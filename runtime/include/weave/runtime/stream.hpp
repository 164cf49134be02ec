// An eager-mode stream: work enqueued on it runs in order on its device's arena, without a
// graph. Obtained from Executor::stream(). Copies refer to the same stream.
#pragma once

#include <functional>
#include <memory>
#include <string_view>

#include "weave/runtime/event.hpp"
#include "weave/runtime/types.hpp"

namespace weave::rt {

namespace detail {
class EagerStream;
}

class Stream {
 public:
  DeviceId device() const;
  StreamId id() const;

  void enqueue(std::string_view name, std::function<void()> work, TaskKind kind = TaskKind::compute,
               TaskTags tags = {}, CostHint cost = {});
  // Sets the event to value once everything enqueued before has run.
  void signal(const Event& event, std::uint64_t value);
  // Work enqueued after this runs once the event is >= value. The stream waits without
  // holding a thread.
  void wait(const Event& event, std::uint64_t value);
  // Blocks the calling thread, helping run queued work, until everything enqueued so far has
  // run. If a task failed, throws its TaskError once and drops the work queued after it;
  // the stream is usable again afterwards. Must not be called from inside a task.
  void synchronize();

 private:
  friend class Executor;
  explicit Stream(std::shared_ptr<detail::EagerStream> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::EagerStream> impl_;
};

}  // namespace weave::rt
