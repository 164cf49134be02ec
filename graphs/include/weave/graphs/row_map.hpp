// Which logical row each local row of a parameter shard is. A shard's rows are a few runs of
// consecutive logical rows (a tensor-parallel slice, SwiGLU's gates then values, one run per
// head of the QKV block), so the map is kept as those runs: a few words a parameter whatever
// its size, which a build without tensors (a prediction of thousands of devices) relies on.
#pragma once

#include <cstdint>
#include <vector>

namespace weave::graphs {

class RowMap {
 public:
  RowMap() = default;
  // Local rows [0, count) are logical rows [first, first + count).
  static RowMap range(std::int64_t first, std::int64_t count);

  // The next `count` local rows are logical rows [first, first + count).
  RowMap& append(std::int64_t first, std::int64_t count);

  // Local rows mapped.
  std::int64_t size() const { return size_; }
  // The logical row of local row `local_row` (0 <= local_row < size()).
  std::int64_t operator[](std::int64_t local_row) const;

 private:
  struct Run {
    std::int64_t local_first, logical_first;  // runs until the next run's local_first
  };
  std::vector<Run> runs_;
  std::int64_t size_ = 0;
};

}  // namespace weave::graphs
