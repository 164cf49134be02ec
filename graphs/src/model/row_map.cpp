#include "weave/graphs/row_map.hpp"

#include <algorithm>

namespace weave::graphs {

RowMap RowMap::range(std::int64_t first, std::int64_t count) {
  return RowMap().append(first, count);
}

RowMap& RowMap::append(std::int64_t first, std::int64_t count) {
  if (count <= 0) return *this;
  // A run that continues the last one extends it.
  const bool continues =
      !runs_.empty() && runs_.back().logical_first + (size_ - runs_.back().local_first) == first;
  if (!continues) runs_.push_back({size_, first});
  size_ += count;
  return *this;
}

std::int64_t RowMap::operator[](std::int64_t local_row) const {
  const auto after =
      std::upper_bound(runs_.begin(), runs_.end(), local_row,
                       [](std::int64_t row, const Run& run) { return row < run.local_first; });
  const Run& run = *(after - 1);
  return run.logical_first + (local_row - run.local_first);
}

}  // namespace weave::graphs
