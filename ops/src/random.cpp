#include "weave/ops/random.hpp"

#include <Random123/philox.h>
#include <fmt/format.h>

#include <stdexcept>

namespace weave::ops {

void check_random_key(const RandomKey& key) {
  if (key.layer >= (1u << 24) || key.site >= 256)
    throw std::invalid_argument(
        fmt::format("random key: layer must be < 2^24 and site < 256, got layer {} and site {}",
                    key.layer, key.site));
}

void uniform4(const RandomKey& key, std::uint64_t token, std::uint64_t feature_quad, float out[4]) {
  using Philox = r123::Philox4x32;
  // Counter: which four features, which token (64 bits), which layer and site. Key: the seed.
  const Philox::ctr_type ctr = {
      {static_cast<std::uint32_t>(feature_quad), static_cast<std::uint32_t>(token),
       static_cast<std::uint32_t>(token >> 32), (key.layer << 8) | key.site}};
  const Philox::key_type k = {
      {static_cast<std::uint32_t>(key.seed), static_cast<std::uint32_t>(key.seed >> 32)}};
  const Philox::ctr_type r = Philox()(ctr, k);
  for (int i = 0; i < 4; ++i)
    out[i] = static_cast<float>(r.v[i] >> 8) * 0x1.0p-24f;  // 24 bits: exact in float
}

float uniform(const RandomKey& key, std::uint64_t token, std::uint64_t feature) {
  float four[4];
  uniform4(key, token, feature / 4, four);
  return four[feature % 4];
}

}  // namespace weave::ops
