// weave preprocess as a library call: a JSON-lines corpus tokenised into an indexed dataset
// holds each document's tokens (and the end-of-document id with append_eod), whatever the number
// of workers; bad lines are refused by their number.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "weave/graphs/indexed_dataset.hpp"
#include "weave/graphs/preprocess.hpp"
#include "weave/graphs/tokenizer.hpp"

#include "temp_dir.hpp"

namespace fs = std::filesystem;
using namespace weave::graphs;

namespace {

// Texts of many lengths, one empty, some non-ASCII; more lines than one batch of the workers.
std::vector<std::string> texts() {
  std::vector<std::string> t;
  std::mt19937 rng(5);
  for (int i = 0; i < 5000; ++i) {
    std::string s = fmt::format("document {} \"quoted\" é ✓ ", i);
    for (std::uint32_t k = rng() % 40; k > 0; --k)
      s += static_cast<char>('a' + rng() % 26);
    t.push_back(i == 17 ? "" : s);
  }
  return t;
}

std::string write_jsonl(const fs::path& dir, const std::vector<std::string>& t) {
  const std::string path = (dir / "corpus.jsonl").string();
  std::ofstream out(path);
  for (const std::string& s : t)
    out << nlohmann::json{{"text", s}, {"title", "t"}}.dump() << "\n";
  return path;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST(Preprocess, EachDocumentIsOneSequenceOfItsTokensEndingWithEod) {
  TempDir dir("preprocess");
  const auto t = texts();
  const auto tokenizer = make_tokenizer({.type = "ByteTokenizer"});
  PreprocessOptions o{.input = write_jsonl(dir.path, t),
                      .output_prefix = (dir.path / "out").string(),
                      .append_eod = true};
  const PreprocessResult r = preprocess_jsonl(o, *tokenizer);
  ASSERT_EQ(r.prefixes, std::vector<std::string>{o.output_prefix + "_text_document"});
  EXPECT_EQ(r.documents, t.size());
  IndexedDataset data(r.prefixes[0]);
  EXPECT_EQ(data.token_type(), TokenType::uint16);  // 257 ids: uint16, as Megatron picks
  ASSERT_EQ(data.documents(), t.size());
  EXPECT_EQ(data.sequences(), t.size() - 1);  // the empty document has no sequence
  std::uint64_t tokens = 0;
  for (std::size_t d = 0; d < t.size(); ++d) {
    const auto first = static_cast<std::size_t>(data.document_start(d));
    const auto end = static_cast<std::size_t>(data.document_start(d + 1));
    ASSERT_EQ(end - first, t[d].empty() ? 0u : 1u) << "document " << d;
    if (t[d].empty()) continue;
    std::vector<std::int32_t> got;
    data.read(first, 0, static_cast<std::size_t>(data.sequence_length(first)), got);
    ASSERT_EQ(got.back(), tokenizer->eod());
    got.pop_back();
    EXPECT_EQ(tokenizer->decode(got), t[d]) << "document " << d;
    tokens += got.size() + 1;
  }
  EXPECT_EQ(r.tokens, tokens);
}

TEST(Preprocess, WorkersWriteTheSameFilesAsOneAndEachKeyItsOwnDataset) {
  TempDir dir("preprocess");
  const auto tokenizer = make_tokenizer({.type = "ByteTokenizer"});
  PreprocessOptions o{.input = write_jsonl(dir.path, texts()), .json_keys = {"text", "title"}};
  o.output_prefix = (dir.path / "one").string();
  const auto one = preprocess_jsonl(o, *tokenizer);
  o.output_prefix = (dir.path / "three").string();
  o.workers = 3;
  const auto three = preprocess_jsonl(o, *tokenizer);
  ASSERT_EQ(one.prefixes.size(), 2u);
  for (std::size_t k = 0; k < 2; ++k)
    for (const char* ext : {".bin", ".idx"})
      EXPECT_EQ(bytes_of(one.prefixes[k] + ext), bytes_of(three.prefixes[k] + ext));
  EXPECT_EQ(IndexedDataset(one.prefixes[1]).tokens(), texts().size());  // each title "t"
}

TEST(Preprocess, ABadLineIsRefusedByItsNumberAndNothingIsLeft) {
  TempDir dir("preprocess");
  const std::string input = (dir.path / "bad.jsonl").string();
  std::ofstream(input) << "{\"text\": \"fine\"}\n\n{\"text\": 3}\n";
  const auto tokenizer = make_tokenizer({.type = "ByteTokenizer"});
  // Two workers: the bad line is the second worker's, whose error must reach the caller.
  PreprocessOptions o{.input = input, .output_prefix = (dir.path / "out").string(), .workers = 2};
  try {
    preprocess_jsonl(o, *tokenizer);
    FAIL() << "a number under \"text\" was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("line 3 has no string under \"text\""), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator{}), 1);
  EXPECT_THROW(make_tokenizer({.type = "SentencePieceTokenizer"}), std::invalid_argument);
}
