// A whole file mapped read-only into memory: an indexed dataset's .bin and .idx are read in
// place, so opening a corpus of any size costs no copy and pages come in as samples touch them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace weave::graphs::data {

class MemoryMap {
 public:
  // Throws std::runtime_error naming the path and the system's reason when it cannot be opened
  // or mapped. An empty file maps to size() 0 and a null data().
  explicit MemoryMap(const std::string& path);
  ~MemoryMap();
  MemoryMap(const MemoryMap&) = delete;
  MemoryMap& operator=(const MemoryMap&) = delete;

  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace weave::graphs::data
