// Tensors on devices: storage counted by the memory tracker under its category, and kernels
// run as graph tasks inside the devices' arenas.
#include <gtest/gtest.h>

#include <random>

#include "weave/devices/device_set.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/linear.hpp"
#include "weave/runtime/graph.hpp"

namespace weave::ops {
namespace {

TEST(DeviceTensor, StorageIsTrackedByCategoryUntilTheLastViewGoes) {
  devices::DeviceSet set(2, {.pin = false});
  rt::MemoryTracker& memory = set.memory();
  {
    const Tensor w = Tensor::zeros({64, 32}, set[1], rt::MemoryCategory::parameters);
    EXPECT_GE(memory.current(1, rt::MemoryCategory::parameters), 64 * 32 * 4);
    EXPECT_EQ(memory.current(0, rt::MemoryCategory::parameters), 0);
    const Tensor view = w.slice(0, 8, 8);
    {
      const Tensor copy = w;  // shares storage: counted once
      EXPECT_LT(memory.current(1, rt::MemoryCategory::parameters), 2 * 64 * 32 * 4);
    }
    EXPECT_EQ(view(0, 0), 0.f);
  }
  EXPECT_EQ(memory.current(1, rt::MemoryCategory::parameters), 0);
  EXPECT_GE(memory.peak(1, rt::MemoryCategory::parameters), 64 * 32 * 4);
}

TEST(DeviceTensor, ShapeOnlyTensorsAreCountedButNotAllocated) {
  devices::DeviceSet set(1, {.pin = false});
  rt::MemoryTracker& memory = set.memory();
  {
    const Tensor t = Tensor::shape_only({64, 32}, set[0], rt::MemoryCategory::activations);
    EXPECT_TRUE(t.defined());
    EXPECT_FALSE(t.has_storage());
    EXPECT_EQ(t.data(), nullptr);
    EXPECT_EQ(memory.current(0, rt::MemoryCategory::activations), 64 * 32 * 4);
    EXPECT_EQ(set[0].allocated_bytes(), 0);
    // Views keep shapes and strides, and no storage.
    const Tensor view = t.slice(0, 8, 8).transpose(0, 1);
    EXPECT_EQ(view.shape(), (Shape{32, 8}));
    EXPECT_EQ(view.stride(0), 1);
    EXPECT_EQ(view.data(), nullptr);
    EXPECT_EQ(t.reshape({32, 64}).numel(), 64 * 32);
    const Tensor real = Tensor::zeros({16}, set[0], rt::MemoryCategory::activations);
    EXPECT_EQ(set[0].allocated_bytes(), 64);
    EXPECT_TRUE(real.has_storage());
  }
  EXPECT_EQ(memory.current(0, rt::MemoryCategory::activations), 0);
  EXPECT_EQ(set[0].allocated_bytes(), 0);
}

TEST(DeviceTensor, KernelsRunAsTasksOnEveryDevice) {
  devices::DeviceSet set(4, {.pin = false});
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> dist(-1, 1);
  const Tensor x = Tensor::empty({2, 96, 4, 16}), w = Tensor::empty({64, 64});
  for (std::int64_t i = 0; i < x.numel(); ++i)
    x.data()[i] = dist(gen);
  for (std::int64_t i = 0; i < w.numel(); ++i)
    w.data()[i] = dist(gen);
  // The reference on the calling thread.
  const Tensor o_ref = Tensor::empty(x.shape()), lse_ref = Tensor::empty({2, 4, 96});
  attention_forward({}, x, x, x, o_ref, lse_ref);
  const Tensor y_ref = Tensor::empty({2, 96, 64});
  linear_forward(o_ref.reshape({2, 96, 64}), w, Tensor{}, y_ref);

  rt::GraphBuilder b;
  std::vector<Tensor> outputs;
  for (rt::DeviceId d = 0; d < 4; ++d) {
    const Tensor o = Tensor::empty(x.shape(), set[d], rt::MemoryCategory::activations);
    const Tensor lse = Tensor::empty({2, 4, 96}, set[d], rt::MemoryCategory::activations);
    const Tensor y = Tensor::empty({2, 96, 64}, set[d], rt::MemoryCategory::activations);
    const rt::TaskId a = b.add({.device = d, .name = "attention"},
                               [=](rt::TaskContext&) { attention_forward({}, x, x, x, o, lse); });
    const rt::TaskId l = b.add({.device = d, .name = "linear"}, [=](rt::TaskContext&) {
      linear_forward(o.reshape({2, 96, 64}), w, Tensor{}, y);
    });
    b.precede(a, l);
    outputs.push_back(y);
  }
  set.executor().run(b.build());
  for (const Tensor& y : outputs) {
    const auto got = y.to_vector(), want = y_ref.to_vector();
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], 1e-5f) << i;
  }
}

}  // namespace
}  // namespace weave::ops
