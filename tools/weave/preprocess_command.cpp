// weave preprocess: Megatron-LM's tools/preprocess_data.py, the same flags, writing the indexed
// datasets `weave train --data-path` (and Megatron's loader) read.
#include <fmt/format.h>

#include <chrono>
#include <memory>

#include "commands.hpp"
#include "output_paths.hpp"
#include "weave/graphs/preprocess.hpp"
#include "weave/graphs/tokenizer.hpp"

namespace weave::cli {

namespace {

struct PreprocessCommandOptions {
  graphs::PreprocessOptions preprocess;
  graphs::TokenizerOptions tokenizer;
};

int run_preprocess(const PreprocessCommandOptions& o) {
  for (const std::string& key : o.preprocess.json_keys)
    for (const char* ext : {".bin", ".idx"})
      check_writable("--output-prefix",
                     fmt::format("{}_{}_document{}", o.preprocess.output_prefix, key, ext));
  const auto tokenizer = graphs::make_tokenizer(o.tokenizer);
  const auto start = std::chrono::steady_clock::now();
  const graphs::PreprocessResult r = graphs::preprocess_jsonl(o.preprocess, *tokenizer);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print(
      "weave preprocess: {} documents, {} tokens ({}, vocabulary {}), {:.1f} MB in {:.2f} s "
      "({:.1f} MB/s, {} worker{})\n",
      r.documents, r.tokens, tokenizer->type(), tokenizer->vocab_size(), r.bytes * 1e-6, seconds,
      r.bytes * 1e-6 / std::max(seconds, 1e-9), o.preprocess.workers,
      o.preprocess.workers == 1 ? "" : "s");
  for (const std::string& prefix : r.prefixes)
    fmt::print("wrote {}.bin and {}.idx: weave train --data-path {}\n", prefix, prefix, prefix);
  return 0;
}

}  // namespace

void add_preprocess_command(CLI::App& app) {
  auto o = std::make_shared<PreprocessCommandOptions>();
  CLI::App* cmd = app.add_subcommand(
      "preprocess",
      "Tokenise a JSON-lines file into Megatron-LM indexed datasets (.bin and .idx), as "
      "Megatron's tools/preprocess_data.py does");
  cmd->add_option("--input", o->preprocess.input, "The JSON-lines file: one document a line")
      ->required();
  cmd->add_option("--json-keys", o->preprocess.json_keys,
                  "The keys of each line's texts: one dataset each")
      ->capture_default_str();
  cmd->add_option("--output-prefix", o->preprocess.output_prefix,
                  "Writes PREFIX_KEY_document.bin and .idx for each key")
      ->required();
  cmd->add_option("--tokenizer-type", o->tokenizer.type,
                  "GPT2BPETokenizer (with --vocab-file and --merge-file) or ByteTokenizer")
      ->capture_default_str();
  cmd->add_option("--vocab-file", o->tokenizer.vocab_file, "GPT-2's vocab.json (encoder.json)");
  cmd->add_option("--merge-file", o->tokenizer.merge_file, "GPT-2's merges.txt (vocab.bpe)");
  cmd->add_flag("--append-eod", o->preprocess.append_eod,
                "End each non-empty document with the tokenizer's end-of-document id");
  cmd->add_option("--workers", o->preprocess.workers, "Threads tokenising side by side")
      ->check(at_least(1))
      ->capture_default_str();
  cmd->footer(
      "Example:\n"
      "  weave preprocess --input corpus.jsonl --json-keys text --tokenizer-type GPT2BPETokenizer "
      "\\\n    --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod "
      "--output-prefix corpus\n"
      "  weave train --data-path corpus_text_document --tokenizer-type GPT2BPETokenizer ...");
  cmd->callback([o] { throw CommandExit{run_preprocess(*o)}; });
}

}  // namespace weave::cli
