// Each byte of the text its own id (0 to 255) and 256 the end of a document: the tokens weave's
// text data has always used, as a tokenizer type for `weave preprocess`.
#pragma once

#include "weave/graphs/tokenizer.hpp"

namespace weave::graphs::data {

class ByteTokenizer final : public Tokenizer {
 public:
  using Tokenizer::encode;
  void encode(std::string_view text, std::vector<std::int32_t>& out) const override;
  std::string decode(std::span<const std::int32_t> ids) const override;
  std::int32_t vocab_size() const override { return 257; }
  std::int32_t eod() const override { return 256; }
  std::string type() const override { return "ByteTokenizer"; }
};

}  // namespace weave::graphs::data
