#include "data/gpt2_bpe_tokenizer.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>
#include <stdexcept>

#include "data/gpt2_pretokenizer.hpp"

namespace weave::graphs::data {

namespace {

std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xc0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3f));
  } else {  // GPT-2's stand-ins stay below U+0800; the vocabulary is read as UTF-8 text
    s += static_cast<char>(0xe0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (c & 0x3f));
  }
  return s;
}

// The symbols of a UTF-8 string: one per code point.
std::vector<std::string> symbols_of(const std::string& text) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < text.size();) {
    std::size_t n = 1;
    while (i + n < text.size() && (static_cast<unsigned char>(text[i + n]) >> 6) == 2)
      ++n;
    out.push_back(text.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace

Gpt2BpeTokenizer::Gpt2BpeTokenizer(const std::string& vocab_file, const std::string& merge_file) {
  // GPT-2's byte stand-ins: printable bytes stand for themselves, the others (controls, space,
  // DEL, the non-breaking space and soft hyphen) for U+0100 onwards in byte order.
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    byte_symbol_[b] = utf8(printable ? static_cast<char32_t>(b) : next++);
    symbol_byte_[byte_symbol_[b]] = static_cast<unsigned char>(b);
  }
  read_vocabulary(vocab_file);
  read_merges(merge_file);
}

void Gpt2BpeTokenizer::read_vocabulary(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error(fmt::format(
        "--vocab-file '{}': cannot read it (GPT-2's vocab.json, also called encoder.json)", path));
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(
        fmt::format("--vocab-file '{}' is not JSON ({}): give GPT-2's vocab.json", path, e.what()));
  }
  if (!vocab.is_object() || vocab.empty())
    throw std::runtime_error(
        fmt::format("--vocab-file '{}' must be a JSON object of symbols and their ids", path));
  symbols_.assign(vocab.size(), {});
  for (const auto& [symbol, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
        id.get<std::int64_t>() >= static_cast<std::int64_t>(vocab.size()) ||
        !symbols_[id.get<std::size_t>()].empty())
      throw std::runtime_error(fmt::format(
          "--vocab-file '{}': \"{}\" has id {}; the ids of {} symbols must be 0 to {}, each once",
          path, symbol, id.dump(), vocab.size(), vocab.size() - 1));
    ids_[symbol] = id.get<std::int32_t>();
    symbols_[id.get<std::size_t>()] = symbol;
  }
  const auto eod = ids_.find("<|endoftext|>");
  if (eod == ids_.end())
    throw std::runtime_error(fmt::format(
        "--vocab-file '{}' has no \"<|endoftext|>\": GPT-2's vocabulary ends documents with it",
        path));
  eod_ = eod->second;
}

void Gpt2BpeTokenizer::read_merges(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error(fmt::format(
        "--merge-file '{}': cannot read it (GPT-2's merges.txt, also called vocab.bpe)", path));
  std::string line;
  std::int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (number == 1 && line.rfind("#version", 0) == 0)) continue;
    const std::size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string::npos)
      throw std::runtime_error(fmt::format(
          "--merge-file '{}' line {} is \"{}\": each line must be two symbols and one space", path,
          number, line));
    ranks_.emplace(line, static_cast<std::int32_t>(ranks_.size()));
  }
}

void Gpt2BpeTokenizer::encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
  std::vector<std::string> word;
  for (const char c : piece)
    word.push_back(byte_symbol_[static_cast<unsigned char>(c)]);
  std::string pair;
  while (word.size() > 1) {
    // The lowest-ranked adjacent pair; then every occurrence of it merged, left to right.
    std::int32_t best = std::numeric_limits<std::int32_t>::max();
    std::size_t at = 0;
    for (std::size_t i = 0; i + 1 < word.size(); ++i) {
      pair = word[i] + ' ' + word[i + 1];
      const auto it = ranks_.find(pair);
      if (it != ranks_.end() && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == std::numeric_limits<std::int32_t>::max()) break;
    const std::string first = word[at], second = word[at + 1];
    std::vector<std::string> merged;
    for (std::size_t i = 0; i < word.size(); ++i) {
      if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
        merged.push_back(first + second);
        ++i;
      } else {
        merged.push_back(word[i]);
      }
    }
    word = std::move(merged);
  }
  for (const std::string& symbol : word) {
    const auto it = ids_.find(symbol);
    if (it == ids_.end())
      throw std::runtime_error(fmt::format(
          "the BPE symbol \"{}\" is not in the vocabulary: --vocab-file and --merge-file do not "
          "belong together",
          symbol));
    out.push_back(it->second);
  }
}

void Gpt2BpeTokenizer::encode(std::string_view text, std::vector<std::int32_t>& out) const {
  // Text repeats its words: each thread remembers the ids of the pieces it has merged (as
  // GPT-2's encoder caches them), without locks, for the tokenizer it last served.
  struct Cache {
    const Gpt2BpeTokenizer* owner = nullptr;
    std::unordered_map<std::string, std::vector<std::int32_t>> ids;
  };
  thread_local Cache cache;
  constexpr std::size_t kMaxEntries = 1 << 18;
  if (cache.owner != this || cache.ids.size() > kMaxEntries) {
    cache.ids.clear();
    cache.owner = this;
  }
  for (const std::string_view piece : gpt2_pieces(text)) {
    auto [it, added] = cache.ids.try_emplace(std::string(piece));
    if (added) encode_piece(piece, it->second);
    out.insert(out.end(), it->second.begin(), it->second.end());
  }
}

std::string Gpt2BpeTokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string text;
  for (const std::int32_t id : ids) {
    if (id < 0 || id >= vocab_size())
      throw std::out_of_range(fmt::format(
          "token id {} is outside GPT-2's vocabulary of {}: the data was tokenised with another "
          "vocabulary",
          id, vocab_size()));
    for (const std::string& symbol : symbols_of(symbols_[static_cast<std::size_t>(id)])) {
      const auto it = symbol_byte_.find(symbol);
      if (it == symbol_byte_.end())
        text += symbol;  // a special symbol such as <|endoftext|> reads as itself
      else
        text += static_cast<char>(it->second);
    }
  }
  return text;
}

}  // namespace weave::graphs::data
