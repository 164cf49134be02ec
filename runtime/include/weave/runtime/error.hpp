// Exceptions the runtime throws. Messages name the rule, the value and the fix.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

#include "weave/runtime/types.hpp"

namespace weave::rt {

// A graph that cannot run: a cycle, an unresolvable event wait, a bad rendezvous, a task
// placed on a device the executor does not have.
class GraphError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A task failed while running; the run was cancelled. what() names the task; cause() is the
// exception the task threw.
class TaskError : public std::runtime_error {
 public:
  TaskError(std::string task_name, TaskId task, std::exception_ptr cause, std::string message);
  const std::string& task_name() const { return task_name_; }
  TaskId task() const { return task_; }
  std::exception_ptr cause() const { return cause_; }

 private:
  std::string task_name_;
  TaskId task_;
  std::exception_ptr cause_;
};

// The message of an exception_ptr, or a description when it is not a std::exception.
std::string describe(std::exception_ptr error);

}  // namespace weave::rt
