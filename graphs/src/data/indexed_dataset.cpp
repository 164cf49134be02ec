#include "weave/graphs/indexed_dataset.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "data/memory_map.hpp"

namespace weave::graphs {

static_assert(std::endian::native == std::endian::little,
              "indexed datasets are little-endian and read in place");

namespace {

constexpr char kMagic[] = "MMIDIDX\0\0";  // 9 bytes (the literal's own NUL is not part of it)
constexpr std::size_t kMagicSize = 9;
constexpr std::size_t kHeaderSize = kMagicSize + 8 + 1 + 8 + 8;

// The .idx's arrays start at byte 34, so they are not aligned for their types: read by copy.
template <typename T>
T load(const std::uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

std::string magic_text(const std::uint8_t* at) {
  std::string s;
  for (std::size_t i = 0; i < kMagicSize; ++i)
    s += at[i] >= 0x20 && at[i] < 0x7f ? fmt::format("{}", static_cast<char>(at[i]))
                                       : fmt::format("\\x{:02x}", at[i]);
  return s;
}

}  // namespace

std::size_t token_size(TokenType type) {
  switch (type) {
    case TokenType::uint8:
    case TokenType::int8:
      return 1;
    case TokenType::int16:
    case TokenType::uint16:
      return 2;
    case TokenType::int32:
    case TokenType::float32:
      return 4;
    case TokenType::int64:
    case TokenType::float64:
      return 8;
  }
  throw std::invalid_argument(
      fmt::format("token type code {} is not one of Megatron's (1 to 8)", static_cast<int>(type)));
}

TokenType token_type_for_vocabulary(std::int64_t vocab_size) {
  return vocab_size < 65500 ? TokenType::uint16 : TokenType::int32;
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  idx_ = std::make_unique<data::MemoryMap>(prefix + ".idx");
  bin_ = std::make_unique<data::MemoryMap>(prefix + ".bin");
  check_index();
  const std::uint8_t* p = idx_->data();
  type_ = static_cast<TokenType>(p[17]);
  sequences_ = load<std::uint64_t>(p + 18);
  document_entries_ = load<std::uint64_t>(p + 26);
  lengths_at_ = kHeaderSize;
  pointers_at_ = lengths_at_ + 4 * sequences_;
  documents_at_ = pointers_at_ + 8 * sequences_;
  check_sequences();
}

IndexedDataset::~IndexedDataset() = default;
IndexedDataset::IndexedDataset(IndexedDataset&&) noexcept = default;
IndexedDataset& IndexedDataset::operator=(IndexedDataset&&) noexcept = default;

// The header: magic, version, token type and the counts the .idx's length must hold.
void IndexedDataset::check_index() const {
  const std::string& path = idx_->path();
  const std::size_t size = idx_->size();
  if (size < kHeaderSize)
    throw std::runtime_error(fmt::format(
        "'{}' holds {} bytes: an indexed dataset's .idx starts with a {}-byte header (truncated: "
        "write it again with weave preprocess or Megatron's tools/preprocess_data.py)",
        path, size, kHeaderSize));
  const std::uint8_t* p = idx_->data();
  if (std::memcmp(p, kMagic, kMagicSize) != 0)
    throw std::runtime_error(fmt::format(
        "'{}' starts with \"{}\": a Megatron indexed dataset's .idx starts with "
        "\"MMIDIDX\\x00\\x00\" "
        "(this is another format or the older lazy/cached one: write it again with weave "
        "preprocess or Megatron's tools/preprocess_data.py)",
        path, magic_text(p)));
  if (const auto version = load<std::uint64_t>(p + 9); version != 1)
    throw std::runtime_error(fmt::format(
        "'{}' is version {} of the indexed dataset format: only version 1 is read (write it "
        "again with weave preprocess or Megatron's tools/preprocess_data.py)",
        path, version));
  const std::uint8_t code = p[17];
  if (code < 1 || code > 8 || code == 6 || code == 7)
    throw std::runtime_error(fmt::format(
        "'{}' has token type code {}: tokens must be integers, code 1 (uint8), 2 (int8), 3 "
        "(int16), 4 (int32), 5 (int64) or 8 (uint16); preprocess the text again",
        path, code));
  const auto n = load<std::uint64_t>(p + 18), d = load<std::uint64_t>(p + 26);
  const std::uint64_t limit = size;  // any count above the file's size cannot fit
  if (n > limit || d > limit || kHeaderSize + 12 * n + 8 * d > size)
    throw std::runtime_error(fmt::format(
        "'{}' holds {} bytes but its header counts {} sequences and {} document index entries, "
        "which need {} (truncated or damaged: write it again)",
        path, size, n, d, kHeaderSize + 12 * n + 8 * d));
  if (d < 1)
    throw std::runtime_error(fmt::format(
        "'{}' has an empty document index: it must hold at least its leading 0 (damaged: write it "
        "again)",
        path));
}

// The arrays: the document index and every sequence inside the .bin.
void IndexedDataset::check_sequences() {
  const std::string& path = idx_->path();
  if (document_start(0) != 0 ||
      document_start(document_entries_ - 1) != static_cast<std::int64_t>(sequences_))
    throw std::runtime_error(fmt::format(
        "'{}': the document index must run from 0 to the sequence count {} (it runs from {} to "
        "{}): the .idx is damaged, write it again",
        path, sequences_, document_start(0), document_start(document_entries_ - 1)));
  for (std::size_t i = 1; i < document_entries_; ++i)
    if (document_start(i) < document_start(i - 1))
      throw std::runtime_error(fmt::format(
          "'{}': document index entry {} is {}, below the entry before it ({}): entries must not "
          "decrease (the .idx is damaged, write it again)",
          path, i, document_start(i), document_start(i - 1)));
  const auto item = static_cast<std::int64_t>(token_size(type_));
  const auto bin_size = static_cast<std::int64_t>(bin_->size());
  tokens_ = 0;
  for (std::size_t i = 0; i < sequences_; ++i) {
    const std::int64_t length = sequence_length(i), pointer = sequence_pointer(i);
    if (length < 0 || pointer < 0 || pointer % item != 0)
      throw std::runtime_error(fmt::format(
          "'{}': sequence {} has length {} and pointer {}: lengths must be >= 0 and pointers "
          ">= 0 multiples of the token size {} (the .idx is damaged, write it again)",
          path, i, length, pointer, item));
    if (pointer > bin_size || length > (bin_size - pointer) / item)
      throw std::runtime_error(fmt::format(
          "'{}' holds {} bytes but sequence {} of '{}' needs {} tokens of {} bytes from byte {}: "
          "the .bin is truncated or belongs to another .idx (write both again with weave "
          "preprocess)",
          bin_->path(), bin_size, i, path, length, item, pointer));
    tokens_ += static_cast<std::uint64_t>(length);
  }
}

std::int32_t IndexedDataset::sequence_length(std::size_t sequence) const {
  return load<std::int32_t>(idx_->data() + lengths_at_ + 4 * sequence);
}

std::int64_t IndexedDataset::sequence_pointer(std::size_t sequence) const {
  return load<std::int64_t>(idx_->data() + pointers_at_ + 8 * sequence);
}

std::int64_t IndexedDataset::document_start(std::size_t i) const {
  return load<std::int64_t>(idx_->data() + documents_at_ + 8 * i);
}

std::vector<std::int32_t> IndexedDataset::sequence_lengths() const {
  std::vector<std::int32_t> lengths(sequences_);
  if (sequences_ > 0) std::memcpy(lengths.data(), idx_->data() + lengths_at_, 4 * sequences_);
  return lengths;
}

void IndexedDataset::read(std::size_t sequence, std::size_t offset, std::size_t length,
                          std::vector<std::int32_t>& out) const {
  if (sequence >= sequences_ ||
      offset + length > static_cast<std::size_t>(sequence_length(sequence)))
    throw std::out_of_range(fmt::format(
        "tokens {} to {} of sequence {} of '{}': outside the dataset ({} sequences{})", offset,
        offset + length, sequence, prefix_, sequences_,
        sequence < sequences_ ? fmt::format(", this one {} tokens", sequence_length(sequence))
                              : ""));
  const std::size_t item = token_size(type_);
  const std::uint8_t* at =
      bin_->data() + static_cast<std::size_t>(sequence_pointer(sequence)) + offset * item;
  const std::size_t first = out.size();
  out.resize(first + length);
  std::int32_t* to = out.data() + first;
  for (std::size_t i = 0; i < length; ++i, at += item) {
    std::int64_t t = 0;
    switch (type_) {
      case TokenType::uint8:
        t = *at;
        break;
      case TokenType::int8:
        t = static_cast<std::int8_t>(*at);
        break;
      case TokenType::int16:
        t = load<std::int16_t>(at);
        break;
      case TokenType::uint16:
        t = load<std::uint16_t>(at);
        break;
      case TokenType::int32:
        t = load<std::int32_t>(at);
        break;
      default:
        t = load<std::int64_t>(at);
        break;
    }
    if (t < INT32_MIN || t > INT32_MAX)
      throw std::runtime_error(
          fmt::format("token {} of sequence {} of '{}' is {}: token ids must fit int32", offset + i,
                      sequence, prefix_, t));
    to[i] = static_cast<std::int32_t>(t);
  }
}

std::int64_t IndexedDataset::max_token() const {
  std::int64_t most = -1;
  std::vector<std::int32_t> chunk;
  constexpr std::size_t kChunk = 1 << 16;
  for (std::size_t s = 0; s < sequences_; ++s) {
    const auto length = static_cast<std::size_t>(sequence_length(s));
    for (std::size_t at = 0; at < length; at += kChunk) {
      chunk.clear();
      read(s, at, std::min(kChunk, length - at), chunk);
      for (const std::int32_t t : chunk)
        most = std::max<std::int64_t>(most, t);
    }
  }
  return most;
}

}  // namespace weave::graphs
