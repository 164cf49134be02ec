#include "weave/runtime/closest_match.hpp"

#include <algorithm>
#include <vector>

namespace weave::rt {

namespace {
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j)
    row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}
}  // namespace

std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  // A typo changes a few characters; beyond a third of the word it is another word.
  const std::size_t within = std::max<std::size_t>(2, word.size() / 3);
  std::string best;
  std::size_t best_distance = std::string::npos;
  for (const std::string& c : candidates) {
    // The distance is at least the lengths' difference: a candidate that cannot come nearer than
    // the best so far, or within reach at all, needs no table (the command line's several hundred
    // flag names, for every unknown one).
    const std::size_t apart =
        c.size() > word.size() ? c.size() - word.size() : word.size() - c.size();
    if (apart >= best_distance || apart > within) continue;
    const std::size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  return best_distance <= within ? best : "";
}

}  // namespace weave::rt
