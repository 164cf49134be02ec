// weave's MoE gates against PyTorch's (tests/data/routing_reference.json, written by
// tools/reference/generate_routing_reference.py from the semantics of MindSpeed's deepspeed_moe
// gate and Megatron-Core's TopKRouter): on the same logits, each token's picked experts and
// which of them are dropped must be equal; the weights and the aux and z losses equal within fp32
// rounding (weave routes in fp32, the reference in fp64 on the same fp32 logits): weights within
// 2e-6 absolute plus 2e-6 relative, losses within 2e-6 relative (32 u32: sums of 32 fp32 terms;
// observed 1.6e-7 and 5e-9). Ampipe chunks are separate gate
// calls: the deepspeed gate's capacity and loss are per call (the layer sums the calls' losses),
// the router's capacity is per call too, its statistics added over the calls before its losses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "hashed_uniform.hpp"
#include "weave/ops/deepspeed_gate.hpp"
#include "weave/ops/moe_dispatch.hpp"
#include "weave/ops/router.hpp"

namespace weave::ops {
namespace {

const nlohmann::json& reference() {
  static const nlohmann::json data = [] {
    std::ifstream in(WEAVE_TEST_DATA_DIR "/routing_reference.json");
    if (!in) throw std::runtime_error("cannot open tests/data/routing_reference.json");
    return nlohmann::json::parse(in);
  }();
  return data;
}

// Element (row, col) of the values named `name`: scale v (+ skew on column 0), v the hash of the
// three (hashed_uniform.hpp), as the generator's hashed.
float hashed(const std::string& name, std::int64_t row, std::int64_t col, double scale,
             double skew) {
  const double v = hashed_uniform(name, row, col);
  return static_cast<float>(scale * v + (col == 0 ? skew : 0.0));
}

// weave's outcome in the reference's form.
struct Outcome {
  std::vector<std::int32_t> index;  // [tokens * k]
  std::vector<bool> dropped;        // [tokens * k]
  std::vector<double> weight;       // [tokens * k], 0 when dropped
  std::vector<std::int64_t> capacity;
  std::vector<double> call_aux;
  double aux = 0, z = 0;
};

// One gate call of the deepspeed gate on `logits`, appended to `out`.
void deepspeed_call(const nlohmann::json& c, const Tensor& logits, Outcome& out) {
  const int k = c.at("top_k");
  const std::int64_t T = logits.shape()[0], E = logits.shape()[1];
  const Tensor probs = Tensor::empty({T, E}), w = Tensor::empty({T, k});
  std::vector<std::int32_t> index(static_cast<std::size_t>(T * k));
  router_forward(RouterOptions{.top_k = k, .renormalize = false}, logits, probs, std::span(index),
                 w);
  const std::int64_t capacity = gate_capacity(T, E, k, c.at("capacity_factor").get<double>());
  const DispatchPlan plan =
      plan_dispatch(index, T, k, E, {.capacity = capacity, .first_choices_first = true});
  gate_weights_after_drops(plan, w);
  // Top-1's loss as the gate computes it (without the coefficient; MindSpeed's layer and weave's
  // discard it), top-2's with the coefficient.
  const double coeff = k == 2 ? c.at("aux_loss_coeff").get<double>() : 1.0;
  const double aux = gate_balance_loss(probs, index, k, coeff);
  out.capacity.push_back(capacity);
  out.call_aux.push_back(aux);
  out.aux += aux;
  for (std::size_t i = 0; i < index.size(); ++i) {
    out.index.push_back(index[i]);
    out.dropped.push_back(plan.pick_row[i] < 0);
    out.weight.push_back(w.data()[i]);
  }
}

// One call of the Megatron-Core router; its statistics added to `total`.
void megatron_call(const nlohmann::json& c, const Tensor& logits, std::span<const float> bias,
                   RouterStatistics& total, Outcome& out) {
  const int k = c.at("top_k");
  const std::int64_t T = logits.shape()[0], E = logits.shape()[1];
  const std::string score = c.at("score");
  const bool per_expert = score != "softmax";
  const RouterOptions options{
      .top_k = k,
      .score = score == "sigmoid"        ? RouterScore::sigmoid
               : score == "sqrtsoftplus" ? RouterScore::sqrtsoftplus
                                         : RouterScore::softmax,
      .renormalize = per_expert ? k > 1 : true,
      .aux_loss_coeff = c.at("aux_loss_coeff"),
      .z_loss_coeff = c.at("z_loss_coeff"),
      .topk_scaling_factor = c.value("scaling_factor", 1.0),
      .num_groups = c.at("group_topk").get<int>() != 0 ? c.at("num_groups").get<int>() : 0,
      .group_topk = c.at("group_topk"),
      .expert_bias = bias};
  const Tensor probs = Tensor::empty({T, E}), w = Tensor::empty({T, k});
  std::vector<std::int32_t> index(static_cast<std::size_t>(T * k));
  const RouterStatistics stats = router_forward(options, logits, probs, std::span(index), w);
  if (total.assignments.empty())
    total = stats;
  else
    total += stats;
  std::span<const float> priority;
  if (c.value("drop_policy", "") == "probs") priority = {w.data(), static_cast<std::size_t>(T * k)};
  const DispatchPlan plan = plan_dispatch(
      index, T, k, E,
      {.capacity_factor = c.value("capacity_factor", 0.0), .pick_priority = priority});
  for (std::size_t i = 0; i < index.size(); ++i) {
    out.index.push_back(index[i]);
    out.dropped.push_back(plan.pick_row[i] < 0);
    out.weight.push_back(plan.pick_row[i] < 0 ? 0.0 : w.data()[i]);
  }
  out.aux = aux_loss(options, total);
  out.z = z_loss(options, total);
}

Outcome route(const nlohmann::json& c) {
  const std::string name = c.at("name");
  const std::int64_t T = c.at("tokens"), E = c.at("experts");
  const int chunks = c.value("chunks", 1);
  const double scale = c.at("scale"), skew = c.value("skew", 0.0);
  std::vector<float> bias;
  if (c.value("expert_bias", false))
    for (std::int64_t e = 0; e < E; ++e)
      bias.push_back(hashed(name + ".bias", 0, e, 0.1, 0.0));
  Outcome out;
  RouterStatistics total;
  const std::int64_t size = T / chunks;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    // An Ampipe chunk: the gate called on consecutive rows of the sequence.
    const Tensor logits = Tensor::empty({size, E});
    for (std::int64_t t = 0; t < size; ++t)
      for (std::int64_t e = 0; e < E; ++e)
        logits.data()[t * E + e] = hashed(name, chunk * size + t, e, scale, skew);
    if (c.at("gate") == "deepspeed")
      deepspeed_call(c, logits, out);
    else
      megatron_call(c, logits, bias, total, out);
  }
  return out;
}

TEST(RoutingReference, PicksDropsWeightsAndLossesMatchPyTorch) {
  const nlohmann::json& cases = reference().at("cases");
  ASSERT_GE(cases.size(), 20u);
  for (const nlohmann::json& r : cases) {
    const nlohmann::json& c = r.at("case");
    SCOPED_TRACE(c.at("name").get<std::string>());
    const Outcome got = route(c);
    const int k = c.at("top_k");
    const auto& experts = r.at("experts");
    ASSERT_EQ(got.index.size(), experts.size() * static_cast<std::size_t>(k));
    std::int64_t dropped = 0;
    for (std::size_t t = 0; t < experts.size(); ++t)
      for (int s = 0; s < k; ++s) {
        SCOPED_TRACE(::testing::Message() << "token " << t << " pick " << s);
        const std::size_t i = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(s);
        EXPECT_EQ(got.index[i], experts[t][s].get<int>());
        EXPECT_EQ(got.dropped[i], r.at("dropped")[t][s].get<bool>());
        const double want = r.at("weights")[t][s];
        EXPECT_NEAR(got.weight[i], want, 2e-6 + 2e-6 * std::abs(want));
        dropped += got.dropped[i] ? 1 : 0;
      }
    // The cases named with "drop" drop picks; the no_drop, dropless and unnamed ones do not.
    const std::string name = c.at("name");
    const bool drops = name.find("drop") != std::string::npos &&
                       name.find("no_drop") == std::string::npos &&
                       name.find("dropless") == std::string::npos;
    EXPECT_EQ(dropped > 0, drops);
    const auto& calls = r.at("calls");
    if (c.at("gate") == "deepspeed") {
      EXPECT_EQ(calls.size(), got.capacity.size());
    }
    for (std::size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(got.capacity.at(i), calls[i].at("capacity").get<std::int64_t>());
      const double want = calls[i].at("aux_loss");
      EXPECT_NEAR(got.call_aux.at(i), want, 2e-6 * std::abs(want));
    }
    const double aux = r.at("aux_loss"), z = r.at("z_loss");
    EXPECT_NEAR(got.aux, aux, 2e-6 * std::abs(aux));
    EXPECT_NEAR(got.z, z, 2e-6 * std::abs(z));
  }
}

}  // namespace
}  // namespace weave::ops
