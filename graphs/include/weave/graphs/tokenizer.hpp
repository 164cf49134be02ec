// Text to token ids and back, by a tokenizer type named as Megatron-LM's --tokenizer-type names
// them: GPT2BPETokenizer (GPT-2's byte-level BPE from --vocab-file and --merge-file) and weave's
// ByteTokenizer (each byte its own id, 0 to 255, and 256 the end of a document).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace weave::graphs {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Appends the ids of `text` to `out`.
  virtual void encode(std::string_view text, std::vector<std::int32_t>& out) const = 0;
  // The text of `ids`; throws std::out_of_range naming an id the vocabulary does not hold.
  virtual std::string decode(std::span<const std::int32_t> ids) const = 0;
  // Ids the tokenizer gives, end-of-document included (Megatron's tokenizer.vocab_size).
  virtual std::int32_t vocab_size() const = 0;
  // The end-of-document id --append-eod adds.
  virtual std::int32_t eod() const = 0;
  // The --tokenizer-type that makes it again (with its files).
  virtual std::string type() const = 0;

  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids;
    encode(text, ids);
    return ids;
  }
};

struct TokenizerOptions {
  std::string type = "ByteTokenizer";  // --tokenizer-type
  std::string vocab_file;              // --vocab-file (GPT2BPETokenizer: vocab.json)
  std::string merge_file;              // --merge-file (GPT2BPETokenizer: merges.txt)
};

// Throws std::invalid_argument naming an unknown type (and the known ones) or a file a type
// needs and was not given; std::runtime_error naming a file that cannot be read or parsed.
std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& options);

}  // namespace weave::graphs
