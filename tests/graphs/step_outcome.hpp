// Runs training steps of a plan and collects what the equivalence tests compare: losses, aux
// losses and every gradient in the parameters' logical layout.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {

struct Outcome {
  std::vector<double> losses, aux;
  std::vector<std::int64_t> dropped;                 // MoE picks full experts dropped, per step
  std::map<std::string, std::vector<double>> grads;  // logical layout
};

inline Outcome run(const ModelConfig& m, ParallelPlan plan, int steps, bool update) {
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  OptimizerConfig opt{.adamw = {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1},
                      .clip_grad = 1.0};
  TrainingStep step(m, plan, opt, set, comm);
  step.set_update_parameters(update);
  Outcome out;
  for (int it = 1; it <= steps; ++it) {
    fill_batches(step, m, plan);  // the same batch every step: the model must learn it
    step.prepare(it, 1e-2);
    set.executor().run(step.graph());
    out.losses.push_back(step.result().loss);
    out.aux.push_back(step.result().aux_loss);
    out.dropped.push_back(step.result().dropped_picks);
  }
  for (int r = 0; r < plan.devices(); ++r)
    for (const Parameter& p : step.shard(r).parameters()) {
      auto& g = out.grads[p.name];
      g.resize(static_cast<std::size_t>(p.logical_rows * p.logical_cols), std::nan(""));
      const std::int64_t rows = local_rows(p), cols = local_cols(p);
      for (std::int64_t lr = 0; lr < rows; ++lr)
        for (std::int64_t lc = 0; lc < cols; ++lc)
          g[static_cast<std::size_t>(p.row_map[lr] * p.logical_cols + p.col_offset + lc)] =
              p.grad.data()[lr * cols + lc];
    }
  return out;
}

inline void expect_same_gradients(const Outcome& serial, const Outcome& parallel) {
  ASSERT_EQ(serial.grads.size(), parallel.grads.size());
  for (const auto& [name, want] : serial.grads) {
    const auto& got = parallel.grads.at(name);
    ASSERT_EQ(got.size(), want.size()) << name;
    double scale = 0;
    for (double v : want)
      scale = std::max(scale, std::abs(v));
    // The first wrong element of each parameter, so a failure shows which parameters differ.
    for (std::size_t i = 0; i < want.size(); ++i)
      if (!(std::abs(got[i] - want[i]) <= 1e-4 * scale + 1e-9)) {
        ADD_FAILURE() << name << " element " << i << ": " << got[i] << ", want " << want[i];
        break;
      }
  }
}

}  // namespace weave::graphs
