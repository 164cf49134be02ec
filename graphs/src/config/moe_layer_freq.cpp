#include "weave/graphs/moe_layer_freq.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cctype>
#include <cstdint>
#include <string>
#include <vector>

#include "weave/graphs/parallel_plan.hpp"

namespace weave::graphs {

namespace {

// More layers than any model weave lays out: a pattern past it is a mistake, not a model.
constexpr std::int64_t kMaxPatternLayers = 1 << 20;

constexpr const char* kAcceptedForms =
    "a whole number N (a MoE layer every N layers), a list of 0s and 1s such as \"[0,1,1,0]\", "
    "or a sum of bracketed lists and parenthesised sums, each times a count, such as "
    "\"([0]*3+[1]*5)\" or \"([1]*3+[0]*1)*3\" (1: a MoE layer, 0: a dense one)";

// A recursive-descent reader of the accepted forms over `text`, failing with the position and
// what it expected there.
class PatternReader {
 public:
  explicit PatternReader(std::string_view text) : text_(text) {}

  std::vector<int> read() {
    std::vector<int> pattern = sum();
    skip_spaces();
    if (at_ < text_.size()) fail("'+' or the end");
    return pattern;
  }

 private:
  // term ('+' term)*
  std::vector<int> sum() {
    std::vector<int> out = term();
    while (take('+')) {
      const std::vector<int> more = term();
      out.insert(out.end(), more.begin(), more.end());
    }
    return out;
  }

  // ('[' entry (',' entry)* ']' | '(' sum ')') ('*' count)?
  std::vector<int> term() {
    std::vector<int> list;
    if (take('(')) {
      list = sum();
      if (!take(')')) fail("'+' or ')'");
    } else {
      if (!take('[')) fail("'[' opening a list or '(' a group");
      do {
        const std::int64_t entry = number("0 or 1");
        if (entry != 0 && entry != 1) fail_at(fmt::format("an entry {}, not 0 or 1", entry));
        list.push_back(static_cast<int>(entry));
      } while (take(','));
      if (!take(']')) fail("',' or ']'");
    }
    std::int64_t count = 1;
    if (take('*')) count = number("a count");
    if (static_cast<std::int64_t>(list.size()) * count > kMaxPatternLayers)
      fail_at(fmt::format("a pattern longer than {} layers", kMaxPatternLayers));
    std::vector<int> out;
    for (std::int64_t i = 0; i < count; ++i)
      out.insert(out.end(), list.begin(), list.end());
    return out;
  }

  std::int64_t number(const char* what) {
    skip_spaces();
    const std::size_t start = at_;
    std::int64_t value = 0;
    while (at_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[at_])) != 0) {
      value = value * 10 + (text_[at_] - '0');
      if (value > kMaxPatternLayers) fail_at(fmt::format("a number above {}", kMaxPatternLayers));
      ++at_;
    }
    if (at_ == start) fail(what);
    return value;
  }

  bool take(char c) {
    skip_spaces();
    if (at_ < text_.size() && text_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }

  void skip_spaces() {
    while (at_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[at_])) != 0)
      ++at_;
  }

  [[noreturn]] void fail(const char* expected) const {
    const std::string found =
        at_ < text_.size() ? fmt::format("'{}'", text_[at_]) : std::string("the end");
    fail_at(fmt::format("{} where {} was expected", found, expected));
  }

  [[noreturn]] void fail_at(const std::string& what) const {
    throw ConfigError(fmt::format("--moe-layer-freq '{}' has {} at character {}: it takes {}",
                                  text_, what, at_ + 1, kAcceptedForms));
  }

  std::string_view text_;
  std::size_t at_ = 0;
};

}  // namespace

void set_moe_layer_freq(ModelConfig& m, std::string_view text) {
  if (text.find('[') != std::string_view::npos) {
    m.moe_layer_pattern = PatternReader(text).read();
    return;
  }
  // A whole number, as Python's int() reads one (surrounding spaces, a sign); its value's rule
  // (>= 1) is the plan's.
  std::size_t at = 0, end = text.size();
  while (at < end && std::isspace(static_cast<unsigned char>(text[at])) != 0)
    ++at;
  while (end > at && std::isspace(static_cast<unsigned char>(text[end - 1])) != 0)
    --end;
  const bool negative = at < end && text[at] == '-';
  if (at < end && (text[at] == '-' || text[at] == '+')) ++at;
  long long value = 0;
  bool digits = at < end;
  for (std::size_t i = at; i < end && digits; ++i) {
    digits = std::isdigit(static_cast<unsigned char>(text[i])) != 0;
    value = value * 10 + (text[i] - '0');
    if (value > (1LL << 30)) digits = false;
  }
  if (!digits)
    throw ConfigError(
        fmt::format("--moe-layer-freq '{}' is neither a whole number nor a pattern: "
                    "it takes {}",
                    text, kAcceptedForms));
  m.moe_layer_freq = static_cast<int>(negative ? -value : value);
  m.moe_layer_pattern.clear();
}

std::string moe_layer_freq_text(const ModelConfig& m) {
  if (m.moe_layer_pattern.empty()) return std::to_string(m.moe_layer_freq);
  return fmt::format("[{}]", fmt::join(m.moe_layer_pattern, ","));
}

}  // namespace weave::graphs
