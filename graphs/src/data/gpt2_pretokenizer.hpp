// GPT-2's pre-tokenisation: text cut into the pieces the pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// matches, left to right (the pattern of GPT-2's own encoder, which Megatron-LM's
// GPT2BPETokenizer applies through Hugging Face's gpt2 tokenizer), so a word keeps its leading
// space and a run of spaces gives all but its last to a piece of its own. BPE merges never
// cross these pieces.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace weave::graphs::data {

// The pieces of UTF-8 `text`, as byte ranges of it (invalid UTF-8 bytes count as symbols).
std::vector<std::string_view> gpt2_pieces(std::string_view text);

}  // namespace weave::graphs::data
