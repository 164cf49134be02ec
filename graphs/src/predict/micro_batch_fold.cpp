#include "replay_figures.hpp"

#include <algorithm>

namespace weave::graphs {

namespace {

// x1 + steps (x2 - x1) when x3 - x2 == x2 - x1; false otherwise.
bool affine(std::int64_t x1, std::int64_t x2, std::int64_t x3, std::int64_t steps,
            std::int64_t& out) {
  if (x3 - x2 != x2 - x1) return false;
  out = x1 + steps * (x2 - x1);
  return true;
}

}  // namespace

std::optional<ReplayFigures> extrapolate(const ReplayFigures& first, const ReplayFigures& second,
                                         const ReplayFigures& third, std::int64_t steps) {
  const std::size_t devices = first.memory.size();
  if (first.groups != second.groups || second.groups != third.groups ||
      second.memory.size() != devices || third.memory.size() != devices ||
      first.replayed_devices != third.replayed_devices)
    return std::nullopt;
  ReplayFigures out;
  out.groups = first.groups;
  out.replayed_devices = first.replayed_devices;
  out.tasks_built = std::max({first.tasks_built, second.tasks_built, third.tasks_built});
  bool ok = affine(first.makespan, second.makespan, third.makespan, steps, out.makespan) &&
            affine(first.compute_busy, second.compute_busy, third.compute_busy, steps,
                   out.compute_busy) &&
            affine(first.compute_idle, second.compute_idle, third.compute_idle, steps,
                   out.compute_idle) &&
            affine(first.exposed_total, second.exposed_total, third.exposed_total, steps,
                   out.exposed_total);
  for (std::size_t k = 0; ok && k < kComputeKindCount; ++k)
    ok = affine(first.compute_by_kind[k], second.compute_by_kind[k], third.compute_by_kind[k],
                steps, out.compute_by_kind[k]);
  out.exposed.resize(first.exposed.size());
  for (std::size_t g = 0; ok && g < out.exposed.size(); ++g)
    ok = affine(first.exposed[g], second.exposed[g], third.exposed[g], steps, out.exposed[g]);
  out.memory.resize(devices);
  out.memory_total.resize(devices);
  for (std::size_t d = 0; ok && d < devices; ++d) {
    ok = affine(first.memory_total[d], second.memory_total[d], third.memory_total[d], steps,
                out.memory_total[d]);
    for (std::size_t c = 0; ok && c < rt::kMemoryCategoryCount; ++c)
      ok = affine(first.memory[d][c], second.memory[d][c], third.memory[d][c], steps,
                  out.memory[d][c]);
  }
  if (!ok) return std::nullopt;
  return out;
}

}  // namespace weave::graphs
