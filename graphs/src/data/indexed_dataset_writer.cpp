#include "weave/graphs/indexed_dataset_writer.hpp"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <stdexcept>

namespace weave::graphs {

namespace {

template <typename T>
void append(std::vector<std::uint8_t>& out, T value) {
  const auto at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

// Appends `token` as `type` (little-endian, as the host), or throws when it does not fit.
void append_token(std::vector<std::uint8_t>& out, TokenType type, std::int32_t token) {
  auto fits = [token](auto lo, auto hi) { return token >= lo && token <= hi; };
  bool ok = true;
  switch (type) {
    case TokenType::uint8:
      ok = fits(0, 255);
      append(out, static_cast<std::uint8_t>(token));
      break;
    case TokenType::int8:
      ok = fits(-128, 127);
      append(out, static_cast<std::int8_t>(token));
      break;
    case TokenType::int16:
      ok = fits(-32768, 32767);
      append(out, static_cast<std::int16_t>(token));
      break;
    case TokenType::uint16:
      ok = fits(0, 65535);
      append(out, static_cast<std::uint16_t>(token));
      break;
    case TokenType::int32:
      append(out, token);
      break;
    default:
      append(out, static_cast<std::int64_t>(token));
      break;
  }
  if (!ok)
    throw std::invalid_argument(fmt::format(
        "token {} does not fit the dataset's token type (code {}): write with a wider type "
        "(the vocabulary decides it: uint16 below 65500 ids, int32 above)",
        token, static_cast<int>(type)));
}

}  // namespace

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, TokenType type)
    : prefix_(prefix), type_(type) {
  if (type == TokenType::float32 || type == TokenType::float64)
    throw std::invalid_argument("an indexed dataset's tokens must be integers, not floats");
  (void)token_size(type);  // refuses codes Megatron does not have
  bin_.open(prefix + ".bin.partial", std::ios::binary | std::ios::trunc);
  if (!bin_)
    throw std::runtime_error(fmt::format(
        "cannot create '{}.bin': check that its folder exists and is writable", prefix));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (finished_) return;
  bin_.close();
  std::error_code ignored;  // a destructor must not throw; the partial files are only litter
  std::filesystem::remove(prefix_ + ".bin.partial", ignored);
  std::filesystem::remove(prefix_ + ".idx.partial", ignored);
}

void IndexedDatasetWriter::add_document(std::span<const std::int32_t> tokens) {
  if (!tokens.empty()) {
    if (tokens.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
      throw std::invalid_argument(fmt::format(
          "a document of {} tokens: a sequence's length is an int32 in the .idx", tokens.size()));
    buffer_.clear();
    for (const std::int32_t t : tokens)
      append_token(buffer_, type_, t);
    bin_.write(reinterpret_cast<const char*>(buffer_.data()),
               static_cast<std::streamsize>(buffer_.size()));
    lengths_.push_back(static_cast<std::int32_t>(tokens.size()));
  }
  document_index_.push_back(static_cast<std::int64_t>(lengths_.size()));
}

void IndexedDatasetWriter::finish() {
  bin_.close();
  if (bin_.fail())
    throw std::runtime_error(fmt::format("writing '{}.bin' failed (is the disk full?)", prefix_));
  std::vector<std::uint8_t> idx(9 + 8 + 1 + 8 + 8);
  std::memcpy(idx.data(), "MMIDIDX\0\0", 9);
  const std::uint64_t version = 1, n = lengths_.size(), d = document_index_.size();
  std::memcpy(idx.data() + 9, &version, 8);
  idx[17] = static_cast<std::uint8_t>(type_);
  std::memcpy(idx.data() + 18, &n, 8);
  std::memcpy(idx.data() + 26, &d, 8);
  for (const std::int32_t length : lengths_)
    append(idx, length);
  std::int64_t pointer = 0;
  const auto item = static_cast<std::int64_t>(token_size(type_));
  for (const std::int32_t length : lengths_) {
    append(idx, pointer);
    pointer += length * item;
  }
  for (const std::int64_t entry : document_index_)
    append(idx, entry);
  std::ofstream out(prefix_ + ".idx.partial", std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(idx.data()), static_cast<std::streamsize>(idx.size()));
  out.close();
  if (out.fail())
    throw std::runtime_error(fmt::format("writing '{}.idx' failed (is the disk full?)", prefix_));
  std::filesystem::rename(prefix_ + ".bin.partial", prefix_ + ".bin");
  std::filesystem::rename(prefix_ + ".idx.partial", prefix_ + ".idx");
  finished_ = true;
}

}  // namespace weave::graphs
