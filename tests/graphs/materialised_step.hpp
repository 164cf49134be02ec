// The step a prediction models, built with tensors and replayed on the virtual clock without
// running its kernels: its length and every device's peak bytes by memory category, the figures
// predict_step must equal.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "weave/devices/device_set.hpp"
#include "weave/graphs/virtual_replay.hpp"
#include "weave/runtime/memory_tracker.hpp"

namespace weave::graphs {

struct MaterialisedStep {
  rt::VirtualRunResult replay;
  std::vector<std::array<std::int64_t, rt::kMemoryCategoryCount>> memory;  // by device
};

inline MaterialisedStep materialised_step(const TrainerConfig& c) {
  MaterialisedStep out;
  out.replay = replay_step(c, {}, false, [&](TrainingStep&, devices::DeviceSet& set) {
    for (std::size_t d = 0; d < set.size(); ++d) {
      std::array<std::int64_t, rt::kMemoryCategoryCount> bytes{};
      for (std::size_t k = 0; k < rt::kMemoryCategoryCount; ++k)
        bytes[k] =
            set.memory().peak(static_cast<rt::DeviceId>(d), static_cast<rt::MemoryCategory>(k));
      out.memory.push_back(bytes);
    }
  });
  return out;
}

}  // namespace weave::graphs
