#include "data/byte_tokenizer.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace weave::graphs::data {

void ByteTokenizer::encode(std::string_view text, std::vector<std::int32_t>& out) const {
  for (const char c : text)
    out.push_back(static_cast<unsigned char>(c));
}

std::string ByteTokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string text;
  for (const std::int32_t id : ids) {
    if (id == eod()) continue;  // the end of a document has no text
    if (id < 0 || id > 255)
      throw std::out_of_range(fmt::format(
          "token id {} is not a byte (0 to 255) or the end of a document (256): the data was "
          "tokenised with another tokenizer (give its --tokenizer-type)",
          id));
    text += static_cast<char>(id);
  }
  return text;
}

}  // namespace weave::graphs::data
