// An eager-mode event: a timeline semaphore. Its value only grows; signal(v) sets it to v and
// a wait for v is satisfied once the value is >= v. Copies share the same event.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace weave::rt {

namespace detail {
struct EventState;
}

class Event {
 public:
  explicit Event(std::string name = {});

  std::string_view name() const;
  std::uint64_t value() const;
  // Sets the value from the host. Throws std::invalid_argument unless value > value().
  void signal(std::uint64_t value);
  // True when a stream that was to signal it failed; waits on it then fail too.
  bool failed() const;

 private:
  friend class Stream;
  friend class Executor;
  std::shared_ptr<detail::EventState> state_;
};

}  // namespace weave::rt
