#include "data/gpt2_pretokenizer.hpp"

#include "data/unicode_classes.hpp"

namespace weave::graphs::data {

namespace {

struct CodePoint {
  char32_t value;
  std::size_t byte;  // where it starts in the text
};

// UTF-8 decoded; a byte that does not start a valid sequence stands for itself (U+FFFD's
// class: neither letter, number nor space).
std::vector<CodePoint> decode_utf8(std::string_view text) {
  std::vector<CodePoint> out;
  for (std::size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    const std::size_t n = b < 0x80         ? 1
                          : (b >> 5) == 6  ? 2
                          : (b >> 4) == 14 ? 3
                          : (b >> 3) == 30 ? 4
                                           : 0;
    char32_t c = n == 1 ? b : n == 2 ? (b & 0x1f) : n == 3 ? (b & 0x0f) : (b & 0x07);
    bool ok = n > 0 && i + n <= text.size();
    for (std::size_t k = 1; ok && k < n; ++k) {
      const auto cont = static_cast<unsigned char>(text[i + k]);
      ok = (cont >> 6) == 2;
      c = (c << 6) | (cont & 0x3f);
    }
    out.push_back({ok ? c : 0xfffd, i});
    i += ok ? n : 1;
  }
  return out;
}

bool other(char32_t c) {
  return !is_space(c) && !is_letter(c) && !is_number(c);
}

// The end of ` ?CLASS+` matched at i, or i when it does not match.
template <typename Class>
std::size_t run(const std::vector<CodePoint>& cps, std::size_t i, Class in_class) {
  std::size_t j = i + (cps[i].value == U' ' ? 1 : 0);
  if (j >= cps.size() || !in_class(cps[j].value)) return i;
  while (j < cps.size() && in_class(cps[j].value))
    ++j;
  return j;
}

// The end of the contraction at i ('s 't 're 've 'm 'll 'd), or i.
std::size_t contraction(const std::vector<CodePoint>& cps, std::size_t i) {
  if (cps[i].value != U'\'') return i;
  for (const std::u32string_view suffix : {U"s", U"t", U"re", U"ve", U"m", U"ll", U"d"}) {
    std::size_t k = 0;
    while (k < suffix.size() && i + 1 + k < cps.size() && cps[i + 1 + k].value == suffix[k])
      ++k;
    if (k == suffix.size()) return i + 1 + k;
  }
  return i;
}

// The end of the piece starting at i: the pattern's first alternative that matches.
std::size_t piece_end(const std::vector<CodePoint>& cps, std::size_t i) {
  if (const std::size_t j = contraction(cps, i); j > i) return j;
  if (const std::size_t j = run(cps, i, is_letter); j > i) return j;
  if (const std::size_t j = run(cps, i, is_number); j > i) return j;
  if (const std::size_t j = run(cps, i, other); j > i) return j;
  std::size_t k = i;  // white space: the run, less its last when text follows it
  while (k < cps.size() && is_space(cps[k].value))
    ++k;
  if (k == cps.size() || k - i == 1) return k;
  return k - 1;
}

}  // namespace

std::vector<std::string_view> gpt2_pieces(std::string_view text) {
  const std::vector<CodePoint> cps = decode_utf8(text);
  std::vector<std::string_view> pieces;
  for (std::size_t i = 0; i < cps.size();) {
    const std::size_t j = piece_end(cps, i);
    const std::size_t from = cps[i].byte, to = j < cps.size() ? cps[j].byte : text.size();
    pieces.push_back(text.substr(from, to - from));
    i = j;
  }
  return pieces;
}

}  // namespace weave::graphs::data
