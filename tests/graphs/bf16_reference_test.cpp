// One device's training against PyTorch's (tests/data/training_reference.json, written by
// tools/reference/generate_training_reference.py): the same GPT, initial values and batch, 20
// AdamW steps, in fp32 and in bf16 mixed precision (bf16 products and kept activations, fp32 main
// parameters, norms, softmax and loss). The fp32 curve shows the two programs are the same model
// and optimizer; the bf16 curve that weave rounds where the reference does.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../ops/hashed_uniform.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/graphs/training_step.hpp"

namespace weave::graphs {
namespace {

const nlohmann::json& reference() {
  static const nlohmann::json data = [] {
    std::ifstream in(WEAVE_TEST_DATA_DIR "/training_reference.json");
    if (!in) throw std::runtime_error("cannot open tests/data/training_reference.json");
    return nlohmann::json::parse(in);
  }();
  return data;
}

// The initial value of logical element (row, col) of parameter `name`: a + s v with v the hash of
// the three (hashed_uniform.hpp); norm weights 1 + 0.1 v, biases 0.05 v, the rest 0.1 v, as the
// generator's init_value.
float init_value(const std::string& name, std::int64_t row, std::int64_t col) {
  const double v = ops::hashed_uniform(name, row, col);
  const auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() &&
           name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (ends_with("norm.weight")) return static_cast<float>(1.0 + 0.1 * v);
  if (ends_with("bias")) return static_cast<float>(0.05 * v);
  return static_cast<float>(0.1 * v);
}

struct Setup {
  ModelConfig model;
  ParallelPlan plan;
  OptimizerConfig optimizer;
  double lr = 0;
};

Setup setup(Precision precision, bool fp32_residual) {
  const nlohmann::json& c = reference().at("config");
  Setup s;
  s.model = ModelConfig{.num_layers = c.at("num_layers"),
                        .hidden_size = c.at("hidden_size"),
                        .num_attention_heads = c.at("num_attention_heads"),
                        .ffn_hidden_size = c.at("ffn_hidden_size"),
                        .seq_length = c.at("seq_length"),
                        .vocab_size = c.at("vocab_size"),
                        .make_vocab_size_divisible_by = c.at("vocab_size")};
  s.model.layernorm_epsilon = c.at("layernorm_epsilon");
  s.model.precision = precision;
  s.model.fp32_residual_connection = fp32_residual;
  s.plan = {.micro_batch_size = c.at("micro_batch_size"),
            .global_batch_size = c.at("micro_batch_size")};
  s.optimizer = {.adamw = {.beta1 = c.at("beta1"),
                           .beta2 = c.at("beta2"),
                           .eps = c.at("eps"),
                           .weight_decay = c.at("weight_decay")},
                 .clip_grad = c.at("clip_grad")};
  s.lr = c.at("lr");
  return s;
}

// The losses of the reference's steps, each before its update, from the reference's initial
// values and its batch (the same every step).
std::vector<double> weave_losses(Precision precision, bool fp32_residual = false) {
  const Setup s = setup(precision, fp32_residual);
  devices::DeviceSet set(1, {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(s.model, s.plan, s.optimizer, set, comm);
  // The same parameters by name and logical shape as the reference's.
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> expected, held;
  for (const nlohmann::json& p : reference().at("parameters"))
    expected[p.at(0).get<std::string>()] = {p.at(1).get<std::int64_t>(),
                                            p.at(2).get<std::int64_t>()};
  for (Parameter& p : step.shard(0).parameters()) {
    held[p.name] = {p.logical_rows, p.logical_cols};
    const std::int64_t rows = local_rows(p), cols = local_cols(p);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        p.value.data()[r * cols + c] = init_value(p.name, p.row_map[r], p.col_offset + c);
  }
  EXPECT_EQ(held, expected);
  std::vector<double> out;
  const int steps = reference().at("steps");
  for (int it = 1; it <= steps; ++it) {
    fill_batches(step, s.model, s.plan);
    step.prepare(it, s.lr);
    set.executor().run(step.graph());
    out.push_back(step.result().loss);
  }
  return out;
}

// The largest |weave - reference| over the steps, printed beside each step's pair.
double max_difference(const std::vector<double>& weave, const nlohmann::json& ref) {
  double worst = 0;
  for (std::size_t i = 0; i < weave.size(); ++i)
    worst = std::max(worst, std::abs(weave[i] - ref.at(i).get<double>()));
  return worst;
}

// fp32: the same arithmetic up to the order of the sums (Eigen's and oneDNN's blockings against
// PyTorch's). One fp32 rounding is u32 = 2^-24 of its value: a sum of n terms in another order
// differs by up to n u32 of it (n = 128, the longest sum, fc2's), and the k = 19 roundings of a
// value's way from the embedding to the loss (bf16_training_test's count) add k u32. AdamW's
// update moves by at most lr times a gradient's relative error, so each step adds at most as much
// again: step i allows i (n + k) u32 of the loss (8.8e-6 of it a step).
double fp32_tolerance(int step, double loss) {
  const double u32 = std::ldexp(1.0, -24);
  return step * (128 + 19) * u32 * loss;
}

TEST(TrainingReference, Fp32LossCurveIsPyTorchs) {
  const std::vector<double> weave = weave_losses(Precision::fp32);
  const nlohmann::json& ref = reference().at("fp32");
  ASSERT_EQ(weave.size(), ref.size());
  for (std::size_t i = 0; i < weave.size(); ++i)
    EXPECT_NEAR(weave[i], ref.at(i).get<double>(),
                fp32_tolerance(static_cast<int>(i + 1), ref.at(i).get<double>()))
        << "step " << i + 1;
  EXPECT_LT(weave.back(), 0.2 * weave.front());  // it learns the batch
  fmt::print("fp32: max |weave - PyTorch| over {} steps: {:.3g} (allowed {:.3g} at the last)\n",
             weave.size(), max_difference(weave, ref),
             fp32_tolerance(static_cast<int>(weave.size()), ref.back().get<double>()));
}

// bf16: weave and the reference round at the same places, so their values differ only where the
// fp32 sums before a rounding, taken in different orders, fall on either side of a bf16 rounding
// boundary: the rounded value then moves by one bf16 step, 2u (u = 2^-8 of the value).
//
// Step 1 (the same parameters): a sum of n terms in another order differs by up to n u32 (u32 =
// 2^-24) of its value, so a share phi = n u32 / (2u) = 2^-10 of the rounded values flip (n = 128,
// the longest sum). Each rounding moves the loss by a random-signed amount: a flip by 2u with
// probability phi (root mean square sqrt(phi) 2u), an ordinary rounding by a uniform error in
// [-u, u] (root mean square 2u / sqrt(12)). All the roundings together move the loss by the
// reference's own bf16 - fp32 gap at step 1; the flips then move it by sqrt(12 phi) ~ 0.11 of that.
//
// Later steps: a different gradient moves AdamW's update, and early on, where the second moment
// is small, the update divides by it: the curves part by far more than step 1's difference (the
// reference's own curve, its products' sums taken in float64 or in two halves, parts from itself
// by up to 3.6e-3 by step 5 with an fp32 residual stream). The reference commits those two
// curves; weave's sums are a third order, so step i allows twice the largest distance of either
// from the reference up to step i: weave is then as close to PyTorch as PyTorch is to itself under
// another order of its sums.
//
// With the bf16 residual stream most flips do not reach the loss: a flip moves a branch's value by
// one of its bf16 steps, and the stream's rounding of its sum with the larger stream value takes
// the same grid point unless the sum lies at a rounding boundary. The reference's other orders then
// part from it by nothing at all up to step 3, and twice nothing allows nothing of what weave's
// values differ by besides flips: its fp32 values (the norms, softmax, loss and update) computed in
// another order, which the fp32 curve's own allowance bounds (fp32_tolerance). Step i allows the
// larger of the two.

// weave's bf16 curve against the reference's curve `key` and the two curves `key`_other_sums of
// the same model, as argued above.
void expect_bf16_curve_within_rounding(const std::vector<double>& weave, const std::string& key) {
  const nlohmann::json& ref = reference().at(key);
  const nlohmann::json& others = reference().at(key + "_other_sums");
  const nlohmann::json& fp32 = reference().at("fp32");
  ASSERT_EQ(weave.size(), ref.size());
  const double n = 128, u = std::ldexp(1.0, -8), u32 = std::ldexp(1.0, -24);
  const double phi = n * u32 / (2 * u);
  const double gap = std::abs(ref.at(0).get<double>() - fp32.at(0).get<double>());
  const double first = std::sqrt(12 * phi) * gap;
  EXPECT_NEAR(weave[0], ref.at(0).get<double>(), first) << "step 1";
  // Not fp32 by accident: weave's first loss is the bf16 one, not the fp32 one.
  EXPECT_GT(std::abs(weave[0] - fp32.at(0).get<double>()), first);
  double spread = 0;
  for (std::size_t i = 1; i < weave.size(); ++i) {
    for (const nlohmann::json& other : others)
      spread = std::max(spread, std::abs(other.at(i).get<double>() - ref.at(i).get<double>()));
    const double allowed =
        std::max(2 * spread, fp32_tolerance(static_cast<int>(i + 1), ref.at(i).get<double>()));
    EXPECT_NEAR(weave[i], ref.at(i).get<double>(), allowed) << "step " << i + 1;
  }
  EXPECT_LT(weave.back(), 0.2 * weave.front());  // it learns the batch
  fmt::print(
      "{}: |weave - PyTorch| at step 1 {:.3g} (allowed {:.3g}), over {} steps {:.3g} (allowed "
      "{:.3g} by the last)\n",
      key, std::abs(weave[0] - ref.at(0).get<double>()), first, weave.size(),
      max_difference(weave, ref), 2 * spread);
}

// The bf16 model with its bf16 residual stream, as Megatron-LM's under --bf16.
TEST(TrainingReference, Bf16LossCurveIsPyTorchsWithinRounding) {
  expect_bf16_curve_within_rounding(weave_losses(Precision::bf16), "bf16");
}

// --fp32-residual-connection against the reference's bf16 model with an fp32 stream.
TEST(TrainingReference, Bf16Fp32ResidualLossCurveIsPyTorchsWithinRounding) {
  expect_bf16_curve_within_rounding(weave_losses(Precision::bf16, true), "bf16_fp32_residual");
}

}  // namespace
}  // namespace weave::graphs
