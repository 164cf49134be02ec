// Writes a Megatron-LM indexed dataset (the format indexed_dataset.hpp describes and reads):
// PREFIX.bin and PREFIX.idx, one sequence per non-empty document as Megatron's
// tools/preprocess_data.py writes without --split-sentences. Both files are written under
// "<name>.partial" and renamed by finish(), so a run that fails leaves no half-written dataset
// under the real names.
#pragma once

#include <cstdint>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "weave/graphs/indexed_dataset.hpp"

namespace weave::graphs {

class IndexedDatasetWriter {
 public:
  // Throws std::invalid_argument for a float token type, std::runtime_error naming the path
  // when PREFIX.bin cannot be created.
  IndexedDatasetWriter(const std::string& prefix, TokenType type);
  // Without finish(), removes the partial files.
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // One document of tokens; an empty one adds a document with no sequence (as Megatron's
  // builder does for a document whose text tokenises to nothing). Throws std::invalid_argument
  // for a token the type cannot hold.
  void add_document(std::span<const std::int32_t> tokens);
  // Writes PREFIX.idx and puts both files in place. Throws std::runtime_error on a write error.
  void finish();

  std::uint64_t documents() const { return document_index_.size() - 1; }

 private:
  std::string prefix_;
  TokenType type_;
  std::ofstream bin_;
  std::vector<std::int32_t> lengths_;
  std::vector<std::int64_t> document_index_{0};
  std::vector<std::uint8_t> buffer_;
  bool finished_ = false;
};

}  // namespace weave::graphs
