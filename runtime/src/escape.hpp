// Quoting names for JSON and DOT output.
#pragma once

#include <string>
#include <string_view>

namespace weave::rt::detail {

// Appends s as the inside of a JSON string.
void append_json_escaped(std::string& out, std::string_view s);
// Appends s as the inside of a DOT double-quoted string.
void append_dot_escaped(std::string& out, std::string_view s);

}  // namespace weave::rt::detail
