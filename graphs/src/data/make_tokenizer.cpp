#include <fmt/format.h>

#include <stdexcept>

#include "data/byte_tokenizer.hpp"
#include "weave/graphs/tokenizer.hpp"

namespace weave::graphs {

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& options) {
  if (options.type == "ByteTokenizer") return std::make_unique<data::ByteTokenizer>();
  throw std::invalid_argument(fmt::format(
      "--tokenizer-type {} is not one weave has: use GPT2BPETokenizer (with --vocab-file and "
      "--merge-file) or ByteTokenizer",
      options.type));
}

}  // namespace weave::graphs
