// Text inside the SVG figures' XML (schedules, replayed pipelines, Ampipe layers): the five
// characters XML reserves written as their entities.
#pragma once

#include <string>
#include <string_view>

namespace weave::graphs {

inline std::string svg_escape(std::string_view text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace weave::graphs
