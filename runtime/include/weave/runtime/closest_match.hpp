// "did you mean ...?" for mistyped names: flags, configuration keys, presets.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace weave::rt {

// The candidate closest to `word` by edit distance, if it is close enough to be a likely typo;
// "" otherwise.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace weave::rt
