// Megatron-LM's indexed dataset, read in place: PREFIX.idx describes the token sequences that
// PREFIX.bin holds back to back, as megatron/core/datasets/indexed_dataset.py writes them
// (tools/preprocess_data.py, or `weave preprocess`).
//
// PREFIX.idx, little-endian: the 9 bytes "MMIDIDX\0\0"; the version, u64 1; the token type's
// code, u8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16); the
// sequence count N, u64; the document index's length D, u64; N int32 sequence lengths (in
// tokens); N int64 pointers (byte offsets of the sequences in .bin); D int64 entries of the
// document index (0, then the sequence count after each document). PREFIX.bin: the tokens.
//
// Both files are memory-mapped; nothing is copied. Opening checks everything a later read
// relies on, so a bad file fails at once, naming the rule, the value and the fix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace weave::graphs {

namespace data {
class MemoryMap;
}

// Megatron's DType codes (the .idx's byte 17).
enum class TokenType : std::uint8_t {
  uint8 = 1,
  int8 = 2,
  int16 = 3,
  int32 = 4,
  int64 = 5,
  float64 = 6,
  float32 = 7,
  uint16 = 8
};

// Bytes a token of `type` takes; throws std::invalid_argument for a code Megatron does not have.
std::size_t token_size(TokenType type);
// The type Megatron's preprocess_data.py picks for a vocabulary: uint16 below 65500, else int32.
TokenType token_type_for_vocabulary(std::int64_t vocab_size);

class IndexedDataset {
 public:
  // Opens PREFIX.idx and PREFIX.bin. Throws std::runtime_error naming the file, the rule broken,
  // the value found and the fix: a missing file, a wrong magic, version or token type (floats
  // are not token ids), an .idx shorter than its counts need, a document index that does not run
  // from 0 up to the sequence count, a negative length, a pointer off the token grid or a .bin
  // too short for the sequences (truncated).
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(IndexedDataset&&) noexcept;
  IndexedDataset& operator=(IndexedDataset&&) noexcept;

  const std::string& prefix() const { return prefix_; }
  TokenType token_type() const { return type_; }
  std::size_t sequences() const { return sequences_; }
  // Documents: the document index's length less one.
  std::size_t documents() const { return document_entries_ - 1; }
  std::int32_t sequence_length(std::size_t sequence) const;
  std::int64_t sequence_pointer(std::size_t sequence) const;
  // Entry `i` of the document index: the first sequence of document i (i == documents(): the
  // sequence count).
  std::int64_t document_start(std::size_t i) const;
  // Every sequence length, copied out (for building sample indices).
  std::vector<std::int32_t> sequence_lengths() const;
  std::uint64_t tokens() const { return tokens_; }
  // The largest token id the sequences hold (-1 for none): a scan of the whole .bin.
  std::int64_t max_token() const;
  // Appends tokens [offset, offset + length) of `sequence` to `out`. Throws std::out_of_range
  // for a range outside the sequence, std::runtime_error for a token outside int32.
  void read(std::size_t sequence, std::size_t offset, std::size_t length,
            std::vector<std::int32_t>& out) const;

 private:
  void check_index() const;
  void check_sequences();

  std::string prefix_;
  std::unique_ptr<data::MemoryMap> idx_, bin_;
  TokenType type_ = TokenType::uint16;
  std::size_t sequences_ = 0, document_entries_ = 0;
  std::size_t lengths_at_ = 0, pointers_at_ = 0, documents_at_ = 0;  // byte offsets in .idx
  std::uint64_t tokens_ = 0;
};

}  // namespace weave::graphs
