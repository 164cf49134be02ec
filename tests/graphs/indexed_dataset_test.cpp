// Megatron's indexed dataset format: what weave writes reads back; what an independent writer
// (tests/graphs/write_indexed_dataset.py, following the format's description) writes reads the
// same and is byte for byte what weave writes; damaged or foreign files are refused by name.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "weave/graphs/indexed_dataset.hpp"
#include "weave/graphs/indexed_dataset_writer.hpp"

#include "temp_dir.hpp"

namespace fs = std::filesystem;
using weave::graphs::IndexedDataset;
using weave::graphs::IndexedDatasetWriter;
using weave::graphs::TempDir;
using weave::graphs::TokenType;

namespace {

// Documents of random lengths (some empty, one long) with ids below `vocab`.
std::vector<std::vector<std::int32_t>> documents(std::uint32_t seed, std::int32_t vocab) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int32_t>> docs(40);
  for (std::size_t i = 0; i < docs.size(); ++i) {
    const std::size_t n = i % 7 == 3 ? 0 : (i == 5 ? 3000 : rng() % 60);
    for (std::size_t t = 0; t < n; ++t)
      docs[i].push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(vocab)));
  }
  return docs;
}

void write(const std::string& prefix, TokenType type,
           const std::vector<std::vector<std::int32_t>>& docs) {
  IndexedDatasetWriter writer(prefix, type);
  for (const auto& d : docs)
    writer.add_document(d);
  writer.finish();
}

// The non-empty documents, each read whole, and the document index.
void expect_holds(const IndexedDataset& data, const std::vector<std::vector<std::int32_t>>& docs) {
  ASSERT_EQ(data.documents(), docs.size());
  std::size_t sequence = 0;
  for (std::size_t i = 0; i < docs.size(); ++i) {
    ASSERT_EQ(data.document_start(i), static_cast<std::int64_t>(sequence)) << "document " << i;
    if (docs[i].empty()) continue;
    std::vector<std::int32_t> got;
    data.read(sequence, 0, static_cast<std::size_t>(data.sequence_length(sequence)), got);
    EXPECT_EQ(got, docs[i]) << "document " << i;
    ++sequence;
  }
  EXPECT_EQ(data.sequences(), sequence);
  EXPECT_EQ(data.document_start(docs.size()), static_cast<std::int64_t>(sequence));
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void overwrite(const std::string& path, std::size_t at, const void* bytes, std::size_t n) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

std::string refusal(const std::string& prefix) {
  try {
    IndexedDataset data(prefix);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(opened)";
}

}  // namespace

TEST(IndexedDataset, WhatIsWrittenReadsBack) {
  TempDir dir("indexed");
  for (const auto& [type, vocab] : {std::pair{TokenType::uint16, 50257},
                                    {TokenType::int32, 1 << 20},
                                    {TokenType::uint8, 256},
                                    {TokenType::int64, 1 << 30}}) {
    const auto docs = documents(static_cast<std::uint32_t>(type), vocab);
    const std::string prefix = dir.prefix(fmt::format("t{}", static_cast<int>(type)));
    write(prefix, type, docs);
    IndexedDataset data(prefix);
    EXPECT_EQ(data.token_type(), type);
    expect_holds(data, docs);
    // A slice inside the long document (document 5, 3000 tokens).
    std::vector<std::int32_t> slice;
    data.read(static_cast<std::size_t>(data.document_start(5)), 100, 7, slice);
    EXPECT_EQ(slice, std::vector<std::int32_t>(docs[5].begin() + 100, docs[5].begin() + 107));
  }
}

TEST(IndexedDataset, AnIndependentWritersFilesReadTheSameAndMatchByteForByte) {
  TempDir dir("indexed");
  const auto docs = documents(7, 50257);
  const std::string json_path = (dir.path / "docs.json").string();
  std::ofstream(json_path) << nlohmann::json(docs).dump();
  const std::string theirs = dir.prefix("python"), ours = dir.prefix("weave");
  const std::string command =
      fmt::format("python3 {} {} 8 {}", WEAVE_INDEXED_WRITER_SCRIPT, json_path, theirs);
  if (std::system("python3 -c pass 2>/dev/null") != 0)
    GTEST_SKIP() << "python3 is not installed: the independent writer cannot run";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  write(ours, TokenType::uint16, docs);
  IndexedDataset data(theirs);
  expect_holds(data, docs);
  EXPECT_EQ(bytes_of(theirs + ".idx"), bytes_of(ours + ".idx"));
  EXPECT_EQ(bytes_of(theirs + ".bin"), bytes_of(ours + ".bin"));
}

TEST(IndexedDataset, ForeignOrDamagedFilesAreRefusedNamingTheRule) {
  TempDir dir("indexed");
  const auto docs = documents(3, 1000);
  const std::string p = dir.prefix("d");
  auto fresh = [&] { write(p, TokenType::uint16, docs); };

  fresh();
  overwrite(p + ".idx", 0, "MMIDIDY", 7);
  EXPECT_NE(refusal(p).find("MMIDIDX"), std::string::npos) << refusal(p);

  fresh();
  const std::uint64_t version = 2;
  overwrite(p + ".idx", 9, &version, 8);
  EXPECT_NE(refusal(p).find("version 2"), std::string::npos) << refusal(p);

  fresh();
  const std::uint8_t float32 = 7;
  overwrite(p + ".idx", 17, &float32, 1);
  EXPECT_NE(refusal(p).find("token type code 7"), std::string::npos) << refusal(p);

  fresh();
  fs::resize_file(p + ".bin", fs::file_size(p + ".bin") - 2);
  EXPECT_NE(refusal(p).find("truncated"), std::string::npos) << refusal(p);

  fresh();
  fs::resize_file(p + ".idx", fs::file_size(p + ".idx") - 8);
  EXPECT_NE(refusal(p).find("need"), std::string::npos) << refusal(p);

  fresh();  // the last document index entry no longer the sequence count
  const std::int64_t wrong = 1;
  overwrite(p + ".idx", fs::file_size(p + ".idx") - 8, &wrong, 8);
  EXPECT_NE(refusal(p).find("document index must run from 0"), std::string::npos) << refusal(p);

  fresh();  // sequence 0's length beyond the .bin
  const std::int32_t huge = 1 << 30;
  overwrite(p + ".idx", 34, &huge, 4);
  EXPECT_NE(refusal(p).find("truncated"), std::string::npos) << refusal(p);

  fs::remove(p + ".bin");
  EXPECT_NE(refusal(p).find("cannot open"), std::string::npos) << refusal(p);
}

TEST(IndexedDataset, ReadsOutsideASequenceAndTokensTooWideForTheTypeAreRefused) {
  TempDir dir("indexed");
  const std::string p = dir.prefix("d");
  write(p, TokenType::uint16, {{1, 2, 3}});
  IndexedDataset data(p);
  std::vector<std::int32_t> out;
  EXPECT_THROW(data.read(0, 2, 2, out), std::out_of_range);
  EXPECT_THROW(data.read(1, 0, 1, out), std::out_of_range);
  IndexedDatasetWriter writer(dir.prefix("w"), TokenType::uint16);
  const std::vector<std::int32_t> wide{70000};
  EXPECT_THROW(writer.add_document(wide), std::invalid_argument);
}
