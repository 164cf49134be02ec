#include "weave/runtime/types.hpp"

namespace weave::rt {

std::string_view to_string(TaskKind kind) {
  switch (kind) {
    case TaskKind::compute:
      return "compute";
    case TaskKind::comm:
      return "comm";
    case TaskKind::copy:
      return "copy";
    case TaskKind::host:
      return "host";
  }
  return "?";
}

std::string_view to_string(Phase phase) {
  switch (phase) {
    case Phase::none:
      return "";
    case Phase::forward:
      return "F";
    case Phase::backward:
      return "B";
    case Phase::weight:
      return "W";
  }
  return "?";
}

}  // namespace weave::rt
