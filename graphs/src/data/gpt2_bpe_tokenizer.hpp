// GPT-2's byte-level BPE (Megatron-LM's GPT2BPETokenizer): each pre-tokenised piece
// (gpt2_pretokenizer.hpp) is written in GPT-2's printable stand-ins for its bytes, then its
// adjacent symbols are merged, lowest merge rank first, while any pair has a rank; the merged
// symbols are looked up in the vocabulary. The vocabulary is vocab.json (symbol to id),
// the ranks merges.txt (one "a b" pair a line, after a "#version" line); "<|endoftext|>" is the
// end of a document.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "weave/graphs/tokenizer.hpp"

namespace weave::graphs::data {

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  // Throws std::runtime_error naming the file and the line or entry that cannot be read.
  Gpt2BpeTokenizer(const std::string& vocab_file, const std::string& merge_file);

  using Tokenizer::encode;
  void encode(std::string_view text, std::vector<std::int32_t>& out) const override;
  std::string decode(std::span<const std::int32_t> ids) const override;
  std::int32_t vocab_size() const override { return static_cast<std::int32_t>(symbols_.size()); }
  std::int32_t eod() const override { return eod_; }
  std::string type() const override { return "GPT2BPETokenizer"; }

 private:
  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const;
  void read_vocabulary(const std::string& path);
  void read_merges(const std::string& path);

  std::unordered_map<std::string, std::int32_t> ids_;
  std::vector<std::string> symbols_;                     // by id
  std::unordered_map<std::string, std::int32_t> ranks_;  // "a b" -> merge rank
  std::string byte_symbol_[256];                         // a byte's stand-in, UTF-8
  std::unordered_map<std::string, unsigned char> symbol_byte_;
  std::int32_t eod_ = 0;
};

}  // namespace weave::graphs::data
