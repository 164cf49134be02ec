// --data-path's blend and --split's shares, read as Megatron-LM reads them
// (get_blend_from_list and parse_and_normalize_split in megatron/core/datasets).
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <stdexcept>

#include "weave/graphs/gpt_dataset.hpp"

namespace weave::graphs {

namespace {

bool parse_number(const std::string& text, double& value) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  return ec == std::errc() && ptr == end && std::isfinite(value);
}

}  // namespace

DataBlend parse_data_blend(const std::vector<std::string>& words) {
  DataBlend blend;
  if (words.size() == 1) {
    blend.prefixes = words;
    return blend;
  }
  if (words.empty() || words.size() % 2 == 1)
    throw std::invalid_argument(
        fmt::format("--data-path got {} words: give one prefix, or weight and prefix pairs like "
                    "\"0.3 A 0.7 B\"",
                    words.size()));
  double sum = 0;
  for (std::size_t i = 0; i < words.size(); i += 2) {
    double w = 0;
    if (!parse_number(words[i], w) || w < 0)
      throw std::invalid_argument(fmt::format(
          "--data-path blend weight '{}' (before '{}') is not a number >= 0: a blend is weight "
          "and prefix pairs, like \"0.3 A 0.7 B\"",
          words[i], words[i + 1]));
    blend.weights.push_back(w);
    blend.prefixes.push_back(words[i + 1]);
    sum += w;
  }
  if (sum <= 0)
    throw std::invalid_argument(
        "--data-path blend weights sum to 0: give some prefix a weight > 0");
  for (double& w : blend.weights)
    w /= sum;
  return blend;
}

std::array<double, 3> parse_data_split(const std::string& split) {
  std::array<double, 3> shares{};
  std::size_t count = 0, at = 0;
  while (at < split.size()) {
    const std::size_t end = split.find_first_of(",/", at);
    std::string word = split.substr(at, end == std::string::npos ? std::string::npos : end - at);
    word.erase(0, word.find_first_not_of(' '));
    word.erase(word.find_last_not_of(' ') + 1);
    double value = 0;
    if (count == 3 || !parse_number(word, value) || value < 0)
      throw std::invalid_argument(fmt::format(
          "--split '{}' must be up to three weights >= 0 for the train, validation and test "
          "parts, like 949,50,1",
          split));
    shares[count++] = value;
    at = end == std::string::npos ? split.size() : end + 1;
  }
  const double sum = shares[0] + shares[1] + shares[2];
  if (!(shares[0] > 0))
    throw std::invalid_argument(fmt::format(
        "--split '{}' leaves nothing to train on: give the first part a weight > 0", split));
  for (double& s : shares)
    s /= sum;
  return shares;
}

}  // namespace weave::graphs
