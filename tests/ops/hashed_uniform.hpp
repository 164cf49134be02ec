// The values the reference scripts compute from a name, a row and a column
// (tools/reference/hashed_values.py), so that only their configurations and results are committed.
#pragma once

#include <cstdint>
#include <string>

namespace weave::ops {

// v uniform in [-1, 1): splitmix64 of the name's FNV-1a plus the row and column, each times an odd
// constant, its top 24 bits.
inline double hashed_uniform(const std::string& name, std::int64_t row, std::int64_t col) {
  std::uint64_t key = 0xCBF29CE484222325ull;
  for (const char ch : name)
    key = (key ^ static_cast<unsigned char>(ch)) * 0x100000001B3ull;
  std::uint64_t x = key + static_cast<std::uint64_t>(row) * 0x9E3779B97F4A7C15ull +
                    static_cast<std::uint64_t>(col) * 0xC2B2AE3D27D4EB4Full;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return 2.0 * (static_cast<double>(x >> 40) / static_cast<double>(1 << 24)) - 1.0;
}

}  // namespace weave::ops
