#include "weave/graphs/host_calibration.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "step_costs.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/ops/attention.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/linear.hpp"
#include "weave/ops/normalization.hpp"
#include "weave/ops/optimizer.hpp"
#include "weave/ops/tensor.hpp"

namespace weave::graphs {

namespace {

using ops::Tensor;
using Clock = std::chrono::steady_clock;

Tensor filled(const ops::Shape& shape, float value) {
  Tensor t = Tensor::empty(shape);
  std::fill_n(t.data(), t.numel(), value);
  return t;
}

// A kernel as every device runs it: `make(device)` builds the device's own tensors (on its
// thread, so the memory is local to it) and returns one run of the kernel.
using KernelFactory = std::function<std::function<void()>()>;

// Seconds one run takes on a device while every device runs it: each device repeats the kernel
// for at least `seconds`, three times, all devices starting each round together; the median
// round of each device, averaged over the devices.
double time_on_devices(devices::DeviceSet& set, double seconds, const KernelFactory& make) {
  const int n = static_cast<int>(set.size());
  std::vector<double> per_device(n, 0);
  std::barrier round(n);
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) {
    threads.emplace_back([&, d] {
      set[static_cast<rt::DeviceId>(d)].arena().execute([&] {
        const std::function<void()> run = make();
        run();  // warm: first touch, caches
        std::vector<double> rounds;
        for (int r = 0; r < 3; ++r) {
          round.arrive_and_wait();
          const auto start = Clock::now();
          std::int64_t runs = 0;
          double elapsed = 0;
          do {
            run();
            ++runs;
            elapsed = std::chrono::duration<double>(Clock::now() - start).count();
          } while (elapsed < seconds);
          rounds.push_back(elapsed / static_cast<double>(runs));
        }
        std::sort(rounds.begin(), rounds.end());
        per_device[d] = rounds[1];
      });
    });
  }
  for (std::thread& t : threads)
    t.join();
  double sum = 0;
  for (double s : per_device)
    sum += s;
  return sum / n;
}

struct ProductSample {
  std::int64_t m, k, n;
  double flops, edges, seconds;
};

// A product's forward and both backward halves, [m, k] x [k, n] each way, as a linear layer
// runs them in a step.
ProductSample measure_product(devices::DeviceSet& set, double seconds, std::int64_t m,
                              std::int64_t k, std::int64_t n) {
  const double t = time_on_devices(set, seconds, [=] {
    auto x = std::make_shared<Tensor>(filled({m, k}, 0.01f));
    auto w = std::make_shared<Tensor>(filled({n, k}, 0.02f));
    auto y = std::make_shared<Tensor>(filled({m, n}, 0.f));
    auto dx = std::make_shared<Tensor>(filled({m, k}, 0.f));
    auto dw = std::make_shared<Tensor>(filled({n, k}, 0.f));
    return [=] {
      ops::linear_forward(*x, *w, Tensor{}, *y);
      ops::linear_backward_input(*y, *w, *dx);
      ops::linear_backward_weight(*x, *y, *dw, Tensor{});
    };
  });
  const rt::CostHint one = cost::matmul(m, k, n);
  return {m, k, n, 3 * one.flops, 3.0 * one.matmul_edges, t};
}

// R and d0 of t = (F + d0 E) / R: a = 1 / R, b = d0 / R minimising the squared relative error
// sum (a F_i / t_i + b E_i / t_i - 1)^2, with b >= 0.
std::pair<double, double> fit_products(const std::vector<ProductSample>& samples) {
  double xx = 0, xy = 0, yy = 0, x1 = 0, y1 = 0;
  for (const ProductSample& s : samples) {
    const double x = s.flops / s.seconds, y = s.edges / s.seconds;
    xx += x * x, xy += x * y, yy += y * y, x1 += x, y1 += y;
  }
  const double det = xx * yy - xy * xy;
  double a = 0, b = 0;
  if (det > 0) {
    a = (x1 * yy - y1 * xy) / det;
    b = (y1 * xx - x1 * xy) / det;
  }
  if (!(det > 0) || b < 0 || a <= 0) {  // no shape effect to find: one rate
    b = 0;
    a = x1 / xx;
  }
  return {1 / a, b / a};
}

}  // namespace

HostCalibration calibrate_host(const CalibrationOptions& options) {
  if (options.devices < 1 || options.devices > 4096)
    throw std::invalid_argument(fmt::format(
        "calibration needs 1 to 4096 devices to measure side by side, got {}", options.devices));
  if (!(options.seconds_per_measurement > 0) || options.seconds_per_measurement > 60)
    throw std::invalid_argument(
        fmt::format("each calibration measurement runs for (0, 60] seconds, got {}",
                    options.seconds_per_measurement));
  devices::DeviceSet set(options.devices);
  const double seconds = options.seconds_per_measurement;
  HostCalibration result;

  // Matrix products: the shapes a small model's layers multiply, from square to skinny (few
  // rows, as a micro-batch's tokens to one expert; a narrow side, as a tensor-parallel shard).
  const std::vector<std::array<std::int64_t, 3>> shapes = {
      {2048, 256, 1024}, {2048, 1024, 256}, {1024, 512, 512}, {512, 256, 768},
      {256, 256, 256},   {128, 256, 1024},  {64, 256, 512},   {32, 256, 1024},
      {16, 512, 512},    {2048, 64, 256},   {2048, 256, 32},  {4096, 128, 128}};
  std::vector<ProductSample> products;
  for (const auto& [m, k, n] : shapes)
    products.push_back(measure_product(set, seconds, m, k, n));
  const auto [rate, overhead] = fit_products(products);
  for (const ProductSample& s : products)
    result.measurements.push_back(
        {.kernel = "matmul",
         .shape = fmt::format("[{}, {}] x [{}, {}], forward and backward", s.m, s.k, s.k, s.n),
         .seconds = s.seconds,
         .modelled_seconds = (s.flops + overhead * s.edges) / rate});

  // Attention: forward and backward of the blockwise kernel, causal, at two shapes.
  struct AttentionShape {
    std::int64_t b, s, heads, d;
  };
  double attention_flops = 0, attention_seconds = 0;
  std::vector<std::pair<AttentionShape, std::pair<double, double>>> attention;
  for (const AttentionShape a : {AttentionShape{4, 256, 4, 64}, AttentionShape{1, 512, 8, 32}}) {
    const double t = time_on_devices(set, seconds, [=] {
      auto q = std::make_shared<Tensor>(filled({a.b, a.s, a.heads, a.d}, 0.01f));
      auto o = std::make_shared<Tensor>(filled({a.b, a.s, a.heads, a.d}, 0.f));
      auto lse = std::make_shared<Tensor>(filled({a.b, a.heads, a.s}, 0.f));
      auto dq = std::make_shared<Tensor>(filled({a.b, a.s, a.heads, a.d}, 0.f));
      auto dk = std::make_shared<Tensor>(filled({a.b, a.s, a.heads, a.d}, 0.f));
      auto dv = std::make_shared<Tensor>(filled({a.b, a.s, a.heads, a.d}, 0.f));
      return [=] {
        const ops::AttentionOptions causal{};
        ops::attention_forward(causal, *q, *q, *q, *o, *lse);
        ops::attention_backward(causal, *q, *q, *q, *o, *lse, *o, *dq, *dk, *dv);
      };
    });
    // cost::causal_attention's count for the whole sequence on one rank: 2 b h s^2 d forward,
    // 2.5 times that backward.
    const double flops =
        3.5 * 2 * static_cast<double>(a.b * a.heads * a.s) * static_cast<double>(a.s * a.d);
    attention_flops += flops;
    attention_seconds += t;
    attention.push_back({a, {flops, t}});
  }
  const double attention_rate = attention_flops / attention_seconds;
  for (const auto& [a, ft] : attention)
    result.measurements.push_back(
        {.kernel = "attention",
         .shape = fmt::format("causal, {} x {} positions, {} heads of {}, forward and backward",
                              a.b, a.s, a.heads, a.d),
         .seconds = ft.second,
         .modelled_seconds = ft.first / attention_rate});

  // Streaming: a norm forward and backward, a residual add and an AdamW step, charged the
  // float32 elements they read and write, as the step's tasks are.
  double streamed_bytes = 0, streamed_seconds = 0;
  std::vector<std::pair<std::string, std::pair<double, double>>> streaming;
  for (const auto& [rows, h] : {std::pair<std::int64_t, std::int64_t>{1024, 256}, {4096, 512}}) {
    const double elements = static_cast<double>(rows * h);
    const double t = time_on_devices(set, seconds, [=] {
      auto x = std::make_shared<Tensor>(filled({rows, h}, 0.5f));
      auto y = std::make_shared<Tensor>(filled({rows, h}, 0.f));
      auto dx = std::make_shared<Tensor>(filled({rows, h}, 0.f));
      auto gamma = std::make_shared<Tensor>(filled({h}, 1.f));
      auto beta = std::make_shared<Tensor>(filled({h}, 0.f));
      auto mean = std::make_shared<Tensor>(filled({rows}, 0.f));
      auto rstd = std::make_shared<Tensor>(filled({rows}, 0.f));
      auto m = std::make_shared<Tensor>(filled({rows, h}, 0.f));
      auto v = std::make_shared<Tensor>(filled({rows, h}, 0.f));
      return [=] {
        ops::layer_norm_forward(*x, *gamma, *beta, 1e-5, *y, *mean, *rstd);
        ops::layer_norm_backward(*x, *gamma, *mean, *rstd, *y, *dx, Tensor{}, Tensor{});
        ops::add(*x, *dx, *y);
        ops::adamw_step(ops::AdamWOptions{}, 1, *dx, *y, *m, *v);
      };
    });
    // Read and written: norm 2, its backward 3, the add 3, AdamW 7 (param, grad, two moments
    // read; param, moments written).
    const double bytes = 4.0 * 15 * elements;
    streamed_bytes += bytes;
    streamed_seconds += t;
    streaming.push_back(
        {fmt::format("[{}, {}]: norm, norm backward, add, AdamW", rows, h), {bytes, t}});
  }
  const double bandwidth = streamed_bytes / streamed_seconds;
  for (const auto& [shape, bt] : streaming)
    result.measurements.push_back({.kernel = "streaming",
                                   .shape = shape,
                                   .seconds = bt.second,
                                   .modelled_seconds = bt.first / bandwidth});

  devices::Accelerator& a = result.preset;
  a.name = fmt::format("this host, {} device(s) of {} core(s)", options.devices,
                       std::max(1, set.topology().cores() / options.devices));
  // The fitted product rate is the host's "peak": the efficiencies are then shares of it.
  a.peak_flops = std::max(rate, attention_rate);
  a.matmul_efficiency = rate / a.peak_flops;
  a.matmul_overhead_dimension = overhead;
  a.attention_efficiency = attention_rate / a.peak_flops;
  a.memory_bandwidth = bandwidth;
  a.memory_efficiency = 1;
  a.memory_bytes = static_cast<std::int64_t>(1) << 30;
  a.devices_per_node = options.devices;
  // Transfers between the devices are copies in shared memory: the virtual clock's host link.
  a.node_link = {.name = "shared memory", .bytes_per_second = 10e9, .latency_us = 1};
  a.network = a.node_link;
  a.sources = {fmt::format(
      "weave calibrate: matrix products over {} shapes (forward and both backward halves), "
      "blockwise attention at {} shapes, norms, residual adds and AdamW at {} sizes, on {} "
      "device(s) side by side",
      products.size(), attention.size(), streaming.size(), options.devices)};
  a.assumed =
      "peak_flops is the fitted rate of large matrix products here (efficiency 1), not a "
      "datasheet figure; memory_bytes (1 GiB) and the shared-memory link (10 GB/s, 1 us) are "
      "placeholders";
  return result;
}

}  // namespace weave::graphs
