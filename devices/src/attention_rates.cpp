#include "weave/devices/attention_rates.hpp"

#include <algorithm>
#include <cmath>

namespace weave::devices {

double AttentionRateTable::rate(double head_dim, double sequence, bool backward_pass) const {
  const std::vector<Row>& rows = backward_pass && !backward.empty() ? backward : forward;
  if (rows.empty()) return 0;
  const Row* row = &rows.front();
  for (const Row& r : rows)
    if (std::abs(std::log2(r.head_dim / head_dim)) < std::abs(std::log2(row->head_dim / head_dim)))
      row = &r;
  const auto& p = row->points;
  if (p.empty()) return 0;
  if (sequence <= p.front().first) return p.front().second;
  if (sequence >= p.back().first) return p.back().second;
  const auto above = std::upper_bound(p.begin(), p.end(), sequence,
                                      [](double s, const auto& point) { return s < point.first; });
  const auto below = above - 1;
  const double t = std::log2(sequence / below->first) / std::log2(above->first / below->first);
  return below->second + t * (above->second - below->second);
}

}  // namespace weave::devices
