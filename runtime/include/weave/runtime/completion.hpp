// Deferred completion: a task that finishes after its function returns.
#pragma once

#include <exception>
#include <memory>

#include "weave/runtime/types.hpp"

namespace weave::rt {

namespace detail {
// Whatever runs the graph (the executor or the virtual clock) receives deferred completions.
class CompletionSink : public std::enable_shared_from_this<CompletionSink> {
 public:
  virtual ~CompletionSink() = default;
  // The running task asked to complete later.
  virtual void begin_deferral(TaskId task) = 0;
  // Its handle was completed (error is null) or failed.
  virtual void complete_deferred(TaskId task, std::exception_ptr error) = 0;
};
}  // namespace detail

// Handle to a deferred task, from TaskContext::defer(). Call complete() or fail() once, from any
// thread; the task's dependents start after that. A Completion destroyed without either fails
// the task, so a forgotten completion ends the run with an error instead of hanging it.
// Calls after the run has ended (it was cancelled) are ignored.
class Completion {
 public:
  Completion() = default;
  Completion(std::shared_ptr<detail::CompletionSink> sink, TaskId task)
      : sink_(std::move(sink)), task_(task) {}
  Completion(Completion&&) noexcept = default;
  Completion& operator=(Completion&& other) noexcept;
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;
  ~Completion();

  void complete();
  void fail(std::exception_ptr error);
  // True until complete() or fail() has been called.
  bool pending() const { return sink_ != nullptr; }

 private:
  std::shared_ptr<detail::CompletionSink> sink_;
  TaskId task_ = kNoTask;
};

}  // namespace weave::rt
