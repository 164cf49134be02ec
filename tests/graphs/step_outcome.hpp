// Runs training steps of a plan and collects what the equivalence tests compare: losses, aux
// losses and every gradient in the parameters' logical layout; a plan against one device; and the
// whole model's gradient along a direction, analytic and numeric.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
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

// The plan's loss, aux loss and every gradient equal the one device's after one step (the
// distributed optimizer keeps each replica's gradient shard only: its gradients are not
// compared), and its 10-step curve equals the one device's and falls.
inline void expect_equals_one_device(const ModelConfig& m, const ParallelPlan& plan) {
  const ParallelPlan serial{.micro_batch_size = plan.micro_batch_size,
                            .global_batch_size = plan.global_batch_size};
  const Outcome a = run(m, serial, 1, false), b = run(m, plan, 1, false);
  EXPECT_NEAR(b.losses[0], a.losses[0], 1e-5 * a.losses[0]);
  EXPECT_NEAR(b.aux[0], a.aux[0], 1e-5 * std::max(a.aux[0], 1e-3));
  if (!plan.distributed_optimizer) expect_same_gradients(a, b);
  const Outcome a10 = run(m, serial, 10, true), b10 = run(m, plan, 10, true);
  for (std::size_t i = 0; i < a10.losses.size(); ++i)
    EXPECT_NEAR(b10.losses[i], a10.losses[i], 1e-4 * a10.losses[i]) << "step " << i + 1;
  EXPECT_LT(a10.losses.back(), a10.losses.front());  // it learns
}

// The whole model's loss (plus aux loss) along a random direction through its parameters, and its
// analytic derivative there (the gradients the step computed). Attention dropout stays on: its
// mask is fixed for a step. `only`: the direction moves only the parameters whose names hold it.
class LineProbe {
 public:
  LineProbe(const ModelConfig& m, ParallelPlan plan, std::string_view only = "")
      : plan_(validated(m, plan)),
        set_(plan_.devices(), {.pin = false}),
        step_(m, plan_, {}, set_, comm_) {
    step_.set_update_parameters(false);
    fill_batches(step_, m, plan_);
    step_.prepare(1, 1e-2);
    objective();
    std::mt19937 gen(7);
    std::normal_distribution<double> normal;
    std::map<std::string, std::vector<double>> grads;
    for (int r = 0; r < plan_.devices(); ++r)
      for (const Parameter& p : step_.shard(r).parameters()) {
        auto& v = direction_[p.name];
        if (v.empty()) {
          v.resize(static_cast<std::size_t>(p.logical_rows * p.logical_cols));
          for (auto& x : v)
            x = normal(gen);
          if (p.name.find(only) == std::string::npos) std::fill(v.begin(), v.end(), 0.0);
        }
        auto& g = grads[p.name];
        g.resize(v.size(), 0.0);
        for (std::int64_t lr = 0; lr < local_rows(p); ++lr)
          for (std::int64_t lc = 0; lc < local_cols(p); ++lc)
            g[logical_index(p, lr, lc)] = p.grad.data()[lr * local_cols(p) + lc];
      }
    for (const auto& [name, g] : grads)
      for (std::size_t i = 0; i < g.size(); ++i)
        analytic_ += g[i] * direction_[name][i];
    for (int r = 0; r < plan_.devices(); ++r)
      for (const Parameter& p : step_.shard(r).parameters())
        origin_[p.name + "#" + std::to_string(r)].assign(p.value.data(),
                                                         p.value.data() + p.value.numel());
  }

  // The derivative along the direction at the origin, from the step's gradients.
  double analytic() const { return analytic_; }

  // The loss plus aux loss at origin + t * direction (the parameters are set afresh from the
  // origin, so no rounding accumulates over calls), and the step's routing digest there.
  std::pair<double, std::uint64_t> at(double t) {
    for (int r = 0; r < plan_.devices(); ++r)
      for (Parameter& p : step_.shard(r).parameters()) {
        const auto& v = direction_[p.name];
        const auto& o = origin_.at(p.name + "#" + std::to_string(r));
        for (std::int64_t lr = 0; lr < local_rows(p); ++lr)
          for (std::int64_t lc = 0; lc < local_cols(p); ++lc) {
            const std::int64_t k = lr * local_cols(p) + lc;
            p.value.data()[k] = static_cast<float>(o[static_cast<std::size_t>(k)] +
                                                   t * v[logical_index(p, lr, lc)]);
          }
      }
    const double f = objective();
    return {f, step_.result().routing_digest};
  }

  // The central difference of the loss over [-eps, eps] at the largest eps of 1e-4, 1e-4 / 2,
  // ... 1e-4 / 16 whose two points route every token as the origin does: a token's top-k choice
  // (or an expert's drop) flipping in between makes the loss jump, and the difference is then no
  // derivative at all. nullopt when every eps flips.
  std::optional<double> numeric() {
    const std::uint64_t routing = at(0).second;
    for (double eps = 1e-4; eps > 5e-6; eps /= 2) {
      const auto [up, up_routing] = at(eps);
      const auto [down, down_routing] = at(-eps);
      if (up_routing == routing && down_routing == routing) return (up - down) / (2 * eps);
    }
    return std::nullopt;
  }

 private:
  static ParallelPlan validated(const ModelConfig& m, ParallelPlan plan) {
    validate(m, plan);
    return plan;
  }
  static std::size_t logical_index(const Parameter& p, std::int64_t lr, std::int64_t lc) {
    return static_cast<std::size_t>(p.row_map[lr] * p.logical_cols + p.col_offset + lc);
  }
  double objective() {
    set_.executor().run(step_.graph());
    return step_.result().loss + step_.result().aux_loss;
  }

  ParallelPlan plan_;
  devices::DeviceSet set_;
  devices::SharedMemoryCommunicator comm_;
  TrainingStep step_;
  double analytic_ = 0;
  std::map<std::string, std::vector<double>> direction_;
  std::map<std::string, std::vector<float>> origin_;  // per parameter and rank
};

// The whole model's gradient along a random direction: analytic and numeric (a central difference
// of the loss over an interval in which no MoE routing decision changes; a failure when there is
// none).
inline std::pair<double, double> directional_derivative(const ModelConfig& m, ParallelPlan plan,
                                                        std::string_view only = "") {
  LineProbe probe(m, plan, only);
  const std::optional<double> numeric = probe.numeric();
  if (!numeric) {
    ADD_FAILURE() << "MoE routing changes within 6e-6 of the point along the direction: no "
                     "central difference there measures the gradient";
    return {probe.analytic(), std::nan("")};
  }
  return {probe.analytic(), *numeric};
}

}  // namespace weave::graphs
