// Megatron-LM's tools/preprocess_data.py as a library call: a JSON-lines file of documents
// tokenised into one indexed dataset per JSON key, "<output_prefix>_<key>_document" (.bin and
// .idx), each document one sequence, the token type chosen by the vocabulary size as Megatron
// chooses it (uint16 below 65500 ids, int32 above).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weave/graphs/tokenizer.hpp"

namespace weave::graphs {

struct PreprocessOptions {
  std::string input;                           // --input: one JSON object a line
  std::vector<std::string> json_keys{"text"};  // --json-keys
  std::string output_prefix;                   // --output-prefix
  bool append_eod = false;  // --append-eod: the tokenizer's eod after each non-empty document
  int workers = 1;          // --workers: threads tokenising side by side
};

struct PreprocessResult {
  std::vector<std::string> prefixes;  // one per JSON key, in order
  std::uint64_t documents = 0;        // lines read
  std::uint64_t tokens = 0;           // over every key
  std::uint64_t bytes = 0;            // of the input
};

// Throws std::runtime_error naming the input and the line for a line that is not a JSON object,
// a key it lacks or a value that is not a string; std::invalid_argument for workers < 1 or no
// key. Nothing is left under the output names when it throws.
PreprocessResult preprocess_jsonl(const PreprocessOptions& options, const Tokenizer& tokenizer);

}  // namespace weave::graphs
