#include <fmt/format.h>

#include <stdexcept>

#include "data/byte_tokenizer.hpp"
#include "data/gpt2_bpe_tokenizer.hpp"
#include "weave/graphs/tokenizer.hpp"

namespace weave::graphs {

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerOptions& options) {
  if (options.type == "ByteTokenizer") return std::make_unique<data::ByteTokenizer>();
  if (options.type == "GPT2BPETokenizer") {
    if (options.vocab_file.empty() || options.merge_file.empty())
      throw std::invalid_argument(fmt::format(
          "--tokenizer-type GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json) and "
          "--merge-file (its merges.txt){}",
          options.vocab_file.empty() ? ": --vocab-file is missing" : ": --merge-file is missing"));
    return std::make_unique<data::Gpt2BpeTokenizer>(options.vocab_file, options.merge_file);
  }
  throw std::invalid_argument(fmt::format(
      "--tokenizer-type {} is not one weave has: use GPT2BPETokenizer (with --vocab-file and "
      "--merge-file) or ByteTokenizer",
      options.type));
}

}  // namespace weave::graphs
