// A tensor a layer either keeps for itself or, when selective recomputation recomputes the
// module that writes it, shares with the same module of every other layer and set of the rank
// (one is recomputed at a time, right before its backward reads it).
#pragma once

#include <utility>

namespace weave::graphs {

// `make()` when kept; else the rank's working-set tensor `shared`, made by `make()` the first
// time a layer takes it.
template <typename T, typename Make>
T kept_or_shared(bool recomputed, T& shared, Make&& make) {
  if (!recomputed) return std::forward<Make>(make)();
  if (!shared.defined()) shared = std::forward<Make>(make)();
  return shared;
}

}  // namespace weave::graphs
