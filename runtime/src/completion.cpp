#include "weave/runtime/completion.hpp"

#include <stdexcept>

#include "weave/runtime/task_context.hpp"

namespace weave::rt {

Completion& Completion::operator=(Completion&& other) noexcept {
  if (this != &other) {
    if (pending()) fail(std::make_exception_ptr(std::logic_error("deferred completion replaced")));
    sink_ = std::move(other.sink_);
    task_ = other.task_;
  }
  return *this;
}

Completion::~Completion() {
  if (pending()) {
    fail(std::make_exception_ptr(std::logic_error(
        "the task deferred its completion and the Completion was destroyed without complete() "
        "or fail(); keep it until the deferred work is done")));
  }
}

void Completion::complete() {
  if (!sink_) throw std::logic_error("Completion::complete() called twice or on an empty handle");
  auto sink = std::move(sink_);
  sink->complete_deferred(task_, nullptr);
}

void Completion::fail(std::exception_ptr error) {
  if (!sink_) throw std::logic_error("Completion::fail() called twice or on an empty handle");
  auto sink = std::move(sink_);
  sink->complete_deferred(task_, std::move(error));
}

Completion TaskContext::defer() {
  if (deferred_) {
    throw std::logic_error("TaskContext::defer() called twice in task '" + std::string(name()) +
                           "'; a task completes once");
  }
  deferred_ = true;
  sink_->begin_deferral(task_);
  return Completion(sink_->shared_from_this(), task_);
}

}  // namespace weave::rt
