// The router's backward against central differences of L = sum(w * r) + aux + z at random logits
// in [-2, 2) and a random r, with the picks (and so the loss's counts) held fixed as the
// perturbation is small: finite differences see the same top-k.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradient_check.hpp"
#include "weave/ops/router.hpp"

namespace weave::ops::testing {

inline void expect_router_gradient(const std::string& what, const RouterOptions& opt,
                                   std::int64_t T, std::int64_t E, std::mt19937& gen) {
  const std::int64_t k = opt.top_k;
  const TensorD logits = random_tensor({T, E}, gen, -2, 2), r = random_tensor({T, k}, gen);
  const TensorD probs = TensorD::empty({T, E}), w = TensorD::empty({T, k});
  std::vector<std::int32_t> index(static_cast<std::size_t>(T * k));
  RouterStatistics stats;
  auto loss = [&] {
    stats = router_forward(opt, logits, probs, std::span(index), w);
    return dot(w, r) + aux_loss(opt, stats) + z_loss(opt, stats);
  };
  loss();
  const TensorD dlogits = TensorD::empty({T, E});
  router_backward(opt, logits, probs, std::span<const std::int32_t>(index), w, r, stats, 1.0,
                  dlogits);
  expect_gradient(what, logits, loss, dlogits);
}

}  // namespace weave::ops::testing
