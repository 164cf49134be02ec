// The residual stream of a 16-bit run. By default its values and its gradient are 16-bit tensors,
// as Megatron-LM's hidden states are under --bf16 and --fp16: every value a layer leaves in the
// stream is exactly a bf16 (fp16) value, and the pipeline's stages, which send the stream's
// values, add no rounding to it. --fp32-residual-connection keeps the stream and its gradient in
// fp32: its pipeline sends fp32 and its prediction counts the stream at 4 bytes a value. An fp32
// run refuses the flag, as Megatron-LM does.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "half_precision_equivalence.hpp"
#include "step_outcome.hpp"
#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/ops/bfloat16.hpp"
#include "weave/ops/float16.hpp"

namespace weave::graphs {
namespace {

const ParallelPlan kOneDevice{.micro_batch_size = 2, .global_batch_size = 4};

ModelConfig with_fp32_residual(ModelConfig m) {
  m.fp32_residual_connection = true;
  return m;
}

// Whether v is a value of `precision`'s 16-bit format (rounding it changes nothing).
bool is_16_bit(Precision precision, float v) {
  if (precision == Precision::fp16) return static_cast<float>(ops::fp16(v)) == v;
  return static_cast<float>(ops::bf16(v)) == v;
}

struct StreamCount {
  std::int64_t values = 0, sixteen_bit = 0;
};

// One step (no update) of one micro-batch a replica; then, over every rank's layers' middles and
// outputs, how many values the stream holds and how many of them are 16-bit values.
StreamCount count_stream(const ModelConfig& m, ParallelPlan plan) {
  validate(m, plan);
  devices::DeviceSet set(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, set, comm);
  step.set_update_parameters(false);
  fill_batches(step, m, plan);
  step.prepare(1, 1e-2);
  set.executor().run(step.graph());
  StreamCount c;
  for (int r = 0; r < plan.devices(); ++r)
    for (int l = 0; l < m.num_layers; ++l) {
      const TrainingStep::ResidualStream s = step.residual_stream(r, l);
      for (const ops::Tensor& t : {s.middle, s.output})
        for (float v : t.to_vector()) {
          ++c.values;
          c.sixteen_bit += is_16_bit(m.precision, v);
        }
    }
  return c;
}

// Every value a layer leaves in the stream (after each residual end) is a 16-bit value by default;
// with --fp32-residual-connection the sums are kept in fp32, and few are: those whose branch the
// hidden dropout (p = 0.1) dropped keep the stream's value, a 16-bit one in the first layer's
// middle (the embedding's output is 16-bit), p / 4 of the values counted here (two layers'
// middles and outputs), and some sums fall on the 16-bit grid by chance (under 5 % of the values
// in all, here): fewer than 10 %. Dense and MoE layers on one device and Ampipe's MoE layers
// (whose residual ends are its own) under expert parallelism, in bf16 and fp16.
TEST(ResidualStream, IsSixteenBitByDefaultAndFp32WithTheFlag) {
  const ParallelPlan one{.micro_batch_size = 2, .global_batch_size = 2};
  ModelConfig ampipe = in(tiny(4), Precision::bf16);
  ampipe.moe_layer_freq = 1;
  ParallelPlan ep2_ampipe2 = kEp2Ampipe2;
  struct Case {
    const char* name;
    ModelConfig model;
    ParallelPlan plan;
  };
  const Case cases[] = {{"gpt bf16", in(gpt(), Precision::bf16), one},
                        {"llama fp16", in(llama(), Precision::fp16), one},
                        {"moe bf16", in(tiny(4), Precision::bf16), one},
                        {"moe bf16 ep2 dp2 ampipe2", ampipe, ep2_ampipe2}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const StreamCount sixteen = count_stream(c.model, c.plan);
    ASSERT_GT(sixteen.values, 0);
    EXPECT_EQ(sixteen.sixteen_bit, sixteen.values);
    const StreamCount wide = count_stream(with_fp32_residual(c.model), c.plan);
    EXPECT_EQ(wide.values, sixteen.values);
    EXPECT_LT(wide.sixteen_bit, wide.values / 10);
  }
}

// The losses (and MoE aux losses) of three steps with updates.
std::vector<double> losses(const ModelConfig& m, const ParallelPlan& plan) {
  const Outcome o = run(m, plan, 3, true);
  std::vector<double> out(o.losses.begin(), o.losses.end());
  if (m.num_experts > 0) out.insert(out.end(), o.aux.begin(), o.aux.end());
  return out;
}

// --fp32-residual-connection changes the step (its stream is not rounded) on one device, under
// tp2 with SP, and under expert parallelism with Ampipe (whose residual ends are its own). That
// the flag's step keeps the stream in fp32 is the count above; that it is the fp32-stream model's
// step is the PyTorch reference's bf16_fp32_residual curve (bf16_reference_test.cpp). Losses
// captured from one build are not compared: the bf16 products differ by host (oneDNN's bf16
// kernels where the CPU has AVX512_BF16, fp32 products of bf16 values elsewhere).
TEST(ResidualStream, Fp32ResidualConnectionChangesTheStep) {
  struct Case {
    const char* name;
    ModelConfig model;
    ParallelPlan plan;
  };
  const Case cases[] = {
      {"gpt bf16", in(gpt(), Precision::bf16), kOneDevice},
      {"llama fp16", in(llama(), Precision::fp16), kOneDevice},
      {"moe bf16", in(tiny(4), Precision::bf16), kOneDevice},
      {"gpt bf16 tp2 sp",
       in(gpt(), Precision::bf16),
       {.tensor_parallel = 2,
        .sequence_parallel = true,
        .micro_batch_size = 2,
        .global_batch_size = 4}},
      {"moe bf16 ep2 dp2 ampipe2", in(tiny(4), Precision::bf16), kEp2Ampipe2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<double> sixteen = losses(c.model, c.plan);
    const std::vector<double> wide = losses(with_fp32_residual(c.model), c.plan);
    ASSERT_EQ(sixteen.size(), wide.size());
    EXPECT_NE(sixteen, wide);
    // Both train the same model: the first losses agree to the stream's rounding (2^-8 of it).
    EXPECT_NEAR(sixteen[0], wide[0], sixteen[0] / 256);
  }
}

// A pipeline stage sends the stream's values and receives its gradient: 16-bit values already by
// default, fp32 ones with --fp32-residual-connection (Megatron-LM's pipeline_dtype follows the
// flag). Either way the boundary rounds nothing the one device does not, so a step of pp2 under
// 1F1B and interleaved is one device's bit for bit: its loss and every gradient. (Llama's untied
// output layer: a tied one's gradient would be summed over the stages in another order.)
TEST(ResidualStream, PipelineStagesAddNoRounding) {
  ModelConfig m = in(llama(), Precision::bf16);
  m.num_layers = 4;
  const ParallelPlan one{.micro_batch_size = 1, .global_batch_size = 4};
  for (const bool fp32_residual : {false, true}) {
    SCOPED_TRACE(fp32_residual ? "--fp32-residual-connection" : "16-bit stream");
    const ModelConfig model = fp32_residual ? with_fp32_residual(m) : m;
    const Outcome serial = run(model, one, 1, false);
    for (const int virtual_stages : {1, 2}) {
      SCOPED_TRACE(virtual_stages == 1 ? "1f1b" : "interleaved");
      const ParallelPlan pp2{.pipeline_parallel = 2,
                             .virtual_pipeline = virtual_stages,
                             .micro_batch_size = 1,
                             .global_batch_size = 4};
      const Outcome piped = run(model, pp2, 1, false);
      EXPECT_EQ(piped.losses, serial.losses);
      EXPECT_EQ(piped.grads, serial.grads);
    }
  }
}

// The prediction counts what a 16-bit step holds of the stream as Megatron-LM holds it: at 2
// bytes a value by default, at 4 with --fp32-residual-connection (the stream's values kept by
// each layer, the chunk's input, the gradient workspace's two stream gradients, and under pp the
// gradients sent and received). A step built with tensors holds the stream in fp32 either way.
TEST(ResidualStream, PredictionCountsTheStreamInItsPrecision) {
  ModelConfig m = in(gpt(), Precision::bf16);
  m.num_layers = 4;
  const ParallelPlan plans[] = {
      kOneDevice, {.pipeline_parallel = 2, .micro_batch_size = 2, .global_batch_size = 8}};
  devices::SharedMemoryCommunicator comm;
  for (const ParallelPlan& plan : plans) {
    SCOPED_TRACE(plan.pipeline_parallel > 1 ? "pp2" : "one device");
    devices::DeviceSet sixteen(plan.devices(), {.pin = false}),
        wide(plan.devices(), {.pin = false});
    devices::DeviceSet real16(plan.devices(), {.pin = false}),
        real32(plan.devices(), {.pin = false});
    ParallelPlan valid = plan;
    validate(m, valid);
    const TrainingStep a(m, valid, {}, sixteen, comm, {.materialize = false});
    const TrainingStep b(with_fp32_residual(m), valid, {}, wide, comm, {.materialize = false});
    const TrainingStep c(m, valid, {}, real16, comm);
    const TrainingStep d(with_fp32_residual(m), valid, {}, real32, comm);
    const std::int64_t T = std::int64_t{m.seq_length} * plan.micro_batch_size, h = m.hidden_size;
    for (int r = 0; r < plan.devices(); ++r) {
      const auto device = static_cast<rt::DeviceId>(r);
      const auto activations = [&](devices::DeviceSet& s) {
        return s.memory().current(device, rt::MemoryCategory::activations);
      };
      const bool pipeline = plan.pipeline_parallel > 1;
      const std::int64_t layers = m.num_layers / plan.pipeline_parallel;
      // Per activation set the chunk's input and each layer's middle and output (and the
      // gradients sent and received between stages); the workspace's d_x and d_x_mid.
      const std::int64_t per_set = T * h * (1 + 2 * layers + (pipeline ? 2 : 0));
      const std::int64_t sets = a.activation_sets(r);
      EXPECT_EQ(activations(wide), activations(sixteen) + 2 * (sets * per_set + 2 * T * h))
          << "rank " << r;
      EXPECT_EQ(activations(real32), activations(real16)) << "rank " << r;
    }
  }
}

TEST(ResidualStream, Fp32ResidualConnectionIsRefusedInAnFp32Run) {
  ParallelPlan plan = kOneDevice;
  try {
    validate(with_fp32_residual(gpt()), plan);
    FAIL() << "an fp32 run took --fp32-residual-connection";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--fp32-residual-connection"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("--bf16"), std::string::npos) << e.what();
  }
  plan = kOneDevice;
  EXPECT_NO_THROW(validate(with_fp32_residual(in(gpt(), Precision::bf16)), plan));
}

}  // namespace
}  // namespace weave::graphs
