#include "weave/runtime/error.hpp"

namespace weave::rt {

TaskError::TaskError(std::string task_name, TaskId task, std::exception_ptr cause,
                     std::string message)
    : std::runtime_error(std::move(message)),
      task_name_(std::move(task_name)),
      task_(task),
      cause_(std::move(cause)) {}

std::string describe(std::exception_ptr error) {
  if (!error) return "no error";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace weave::rt
