#include "weave/graphs/host_calibration.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "step/step_costs.hpp"
#include "weave/devices/attention_rates.hpp"
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

// A kernel as every device runs it: called on each device's thread, it builds that device's own
// tensors (so the memory is local to the device) and returns one run of the kernel.
using KernelFactory = std::function<std::function<void()>()>;

// Seconds one run takes on a device while every device runs it: each device repeats the kernel
// for at least `seconds`, three times, all devices starting each round together; the median
// round of each device, averaged over the devices. A device whose kernel throws leaves the
// rounds (so the others do not wait for it) and the first error is rethrown.
double time_on_devices(devices::DeviceSet& set, double seconds, const KernelFactory& make) {
  const int n = static_cast<int>(set.size());
  std::vector<double> per_device(n, 0);
  std::vector<std::exception_ptr> errors(n);
  std::barrier round(n);
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) {
    threads.emplace_back([&, d] {
      int rounds_joined = 0;
      try {
        set[static_cast<rt::DeviceId>(d)].arena().execute([&] {
          const std::function<void()> run = make();
          run();  // warm: first touch, caches
          std::vector<double> rounds;
          for (int r = 0; r < 3; ++r) {
            round.arrive_and_wait();
            ++rounds_joined;
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
      } catch (...) {
        errors[d] = std::current_exception();
        if (rounds_joined < 3) round.arrive_and_drop();
      }
    });
  }
  for (std::thread& t : threads)
    t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  double sum = 0;
  for (double s : per_device)
    sum += s;
  return sum / n;
}

struct ProductSample {
  std::int64_t m, k, n;
  double flops, edges, seconds;
};

// Sets of buffers a kernel cycles through so that together they exceed the last-level cache: a
// step's tensors are many and each is touched once or twice, so its kernels read memory cold.
int cold_sets(double bytes_per_set) {
  constexpr double kBeyondCache = 96.0 * (1 << 20);
  return static_cast<int>(std::clamp(std::ceil(kBeyondCache / bytes_per_set), 1.0, 64.0));
}

// A product's forward and both backward halves, [m, k] x [k, n] each way, as a linear layer
// runs them in a step.
ProductSample measure_product(devices::DeviceSet& set, double seconds, std::int64_t m,
                              std::int64_t k, std::int64_t n) {
  struct Buffers {
    Tensor x, w, y, dx, dw;
  };
  const int sets = cold_sets(4.0 * static_cast<double>(2 * m * k + 2 * n * k + m * n));
  const double t = time_on_devices(set, seconds, [=] {
    auto buffers = std::make_shared<std::vector<Buffers>>();
    for (int i = 0; i < sets; ++i)
      buffers->push_back({filled({m, k}, 0.01f), filled({n, k}, 0.02f), filled({m, n}, 0.f),
                          filled({m, k}, 0.f), filled({n, k}, 0.f)});
    auto next = std::make_shared<int>(0);
    return [=] {
      Buffers& b = (*buffers)[static_cast<std::size_t>((*next)++ % sets)];
      ops::linear_forward(b.x, b.w, Tensor{}, b.y);
      ops::linear_backward_input(b.y, b.w, b.dx);
      ops::linear_backward_weight(b.x, b.y, b.dw, Tensor{});
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

using Measurements = std::vector<KernelMeasurement>;

void check_options(const CalibrationOptions& options) {
  if (options.devices < 1 || options.devices > 4096)
    throw std::invalid_argument(fmt::format(
        "calibration needs 1 to 4096 devices to measure side by side, got {}", options.devices));
  if (!(options.seconds_per_measurement > 0) || options.seconds_per_measurement > 60)
    throw std::invalid_argument(
        fmt::format("each calibration measurement runs for (0, 60] seconds, got {}",
                    options.seconds_per_measurement));
}

struct ProductRates {
  double rate, overhead;  // R and d0 of fit_products
  std::size_t shapes;
};

// Matrix products: the shapes a small model's layers multiply, from square to skinny (few rows,
// as a micro-batch's tokens to one expert; a narrow side, as a tensor-parallel shard).
ProductRates calibrate_products(devices::DeviceSet& set, double seconds, Measurements& out) {
  const std::vector<std::array<std::int64_t, 3>> shapes = {
      {2048, 256, 1024}, {2048, 1024, 256}, {1024, 512, 512}, {512, 256, 768},
      {256, 256, 256},   {128, 256, 1024},  {64, 256, 512},   {32, 256, 1024},
      {16, 512, 512},    {2048, 64, 256},   {2048, 256, 32},  {4096, 128, 128}};
  std::vector<ProductSample> products;
  for (const auto& [m, k, n] : shapes)
    products.push_back(measure_product(set, seconds, m, k, n));
  const auto [rate, overhead] = fit_products(products);
  for (const ProductSample& s : products)
    out.push_back(
        {.kernel = "matmul",
         .shape = fmt::format("[{}, {}] x [{}, {}], forward and backward", s.m, s.k, s.k, s.n),
         .seconds = s.seconds,
         .modelled_seconds = (s.flops + overhead * s.edges) / rate});
  return {rate, overhead, products.size()};
}

struct AttentionShape {
  std::int64_t b, s, heads, d;
};

// The causal blockwise attention's forward or backward at one shape, cycling through cold sets
// of buffers; the forward has filled o and lse, which the backward reads.
KernelFactory attention_kernel(AttentionShape a, bool backward) {
  struct AttentionBuffers {
    Tensor q, o, lse, dq, dk, dv;
  };
  const int sets = cold_sets(4.0 * 5 * static_cast<double>(a.b * a.s * a.heads * a.d));
  return [=] {
    auto buffers = std::make_shared<std::vector<AttentionBuffers>>();
    const ops::Shape shape{a.b, a.s, a.heads, a.d};
    for (int i = 0; i < sets; ++i)
      buffers->push_back({filled(shape, 0.01f), filled(shape, 0.f),
                          filled({a.b, a.heads, a.s}, 0.f), filled(shape, 0.f), filled(shape, 0.f),
                          filled(shape, 0.f)});
    if (backward)  // o and lse, which the backward reads
      for (AttentionBuffers& x : *buffers)
        ops::attention_forward(ops::AttentionOptions{}, x.q, x.q, x.q, x.o, x.lse);
    auto next = std::make_shared<int>(0);
    return std::function<void()>([=] {
      AttentionBuffers& x = (*buffers)[static_cast<std::size_t>((*next)++ % sets)];
      const ops::AttentionOptions causal{};
      if (backward)
        ops::attention_backward(causal, x.q, x.q, x.q, x.o, x.lse, x.o, x.dq, x.dk, x.dv);
      else
        ops::attention_forward(causal, x.q, x.q, x.q, x.o, x.lse);
    });
  };
}

struct AttentionRates {
  double forward, backward;  // flop/s over every shape measured: the flat rates
  devices::AttentionRateTable table;
  std::size_t shapes;
};

// Attention: the blockwise kernel's forward and backward apart (a step runs them in tasks of their
// own), causal, cold, at the head dimensions and sequence lengths of the models a host trains. Its
// rate moves with both more than a flat share can say: each score's exponential, maximum and sum
// cost the same whatever the head dimension, so narrow heads run slower per FLOP (heads of 32 and
// of 64 differ by a third here), and a short sequence gives each block of queries few keys. The
// measurements become the preset's table of this kernel by head dimension and sequence length
// (devices::AttentionRateTable), which prices a run at its own heads and the sequence its kernel
// calls see; their totals give the flat rates other backends fall back to.
AttentionRates calibrate_attention(devices::DeviceSet& set, double seconds, Measurements& out) {
  struct Sample {
    AttentionShape shape;
    double flops, forward, backward;
  };
  std::vector<Sample> samples;
  AttentionRates rates{
      .forward = 0,
      .backward = 0,
      .table = {.kernel = "weave's blockwise causal attention on this host (weave calibrate)"},
      .shapes = 0};
  double forward_flops = 0, forward_seconds = 0, backward_flops = 0, backward_seconds = 0;
  for (const std::int64_t d : {16, 32, 64, 128}) {
    devices::AttentionRateTable::Row forward_row{.head_dim = static_cast<double>(d)};
    devices::AttentionRateTable::Row backward_row{.head_dim = static_cast<double>(d)};
    for (const std::int64_t s : {128, 256, 512, 1024}) {
      // About 2^28 FLOPs a forward call (a few milliseconds), in heads of one sequence.
      const std::int64_t heads =
          std::clamp<std::int64_t>((std::int64_t{1} << 27) / (s * s * d), 1, 64);
      const AttentionShape a{1, s, heads, d};
      const double forward = time_on_devices(set, seconds, attention_kernel(a, false));
      const double backward = time_on_devices(set, seconds, attention_kernel(a, true));
      // cost::causal_attention's count for the whole sequence on one rank: 2 b h s^2 d forward,
      // 2.5 times that backward.
      const double flops =
          2 * static_cast<double>(a.b * a.heads * a.s) * static_cast<double>(a.s * a.d);
      forward_flops += flops, forward_seconds += forward;
      backward_flops += 2.5 * flops, backward_seconds += backward;
      forward_row.points.emplace_back(static_cast<double>(s), flops / forward);
      backward_row.points.emplace_back(static_cast<double>(s), 2.5 * flops / backward);
      samples.push_back({a, flops, forward, backward});
    }
    rates.table.forward.push_back(std::move(forward_row));
    rates.table.backward.push_back(std::move(backward_row));
  }
  rates.forward = forward_flops / forward_seconds;
  rates.backward = backward_flops / backward_seconds;
  rates.shapes = samples.size();
  // What the preset prices each measured shape at: the table's rate of its head dimension and
  // sequence length.
  for (const Sample& x : samples) {
    const std::string shape = fmt::format("causal, {} x {} positions, {} heads of {}", x.shape.b,
                                          x.shape.s, x.shape.heads, x.shape.d);
    const auto d = static_cast<double>(x.shape.d), s = static_cast<double>(x.shape.s);
    out.push_back({.kernel = "attention",
                   .shape = shape + ", forward",
                   .seconds = x.forward,
                   .modelled_seconds = x.flops / rates.table.rate(d, s, false)});
    out.push_back({.kernel = "attention",
                   .shape = shape + ", backward",
                   .seconds = x.backward,
                   .modelled_seconds = 2.5 * x.flops / rates.table.rate(d, s, true)});
  }
  return rates;
}

// One step's streaming kernels at one size: a norm, its backward and a residual add over
// [rows, h] activations; AdamW, the gradient norm and zeroing over `params` parameters.
KernelFactory streaming_kernel(std::int64_t rows, std::int64_t h, std::int64_t params, int sets) {
  struct StreamingBuffers {
    Tensor x, y, dx, gamma, beta, mean, rstd, p, g, m, v;
  };
  return [=] {
    auto buffers = std::make_shared<std::vector<StreamingBuffers>>();
    for (int i = 0; i < sets; ++i)
      buffers->push_back({filled({rows, h}, 0.5f), filled({rows, h}, 0.f), filled({rows, h}, 0.f),
                          filled({h}, 1.f), filled({h}, 0.f), filled({rows}, 0.f),
                          filled({rows}, 0.f), filled({params}, 0.1f), filled({params}, 0.01f),
                          filled({params}, 0.f), filled({params}, 0.f)});
    auto next = std::make_shared<int>(0);
    return std::function<void()>([=] {
      StreamingBuffers& b = (*buffers)[static_cast<std::size_t>((*next)++ % sets)];
      ops::layer_norm_forward(b.x, b.gamma, b.beta, 1e-5, b.y, b.mean, b.rstd);
      ops::layer_norm_backward(b.x, b.gamma, b.mean, b.rstd, b.y, b.dx, Tensor{}, Tensor{});
      ops::add(b.x, b.dx, b.y);
      const Tensor grads[] = {b.g};
      volatile double norm = ops::squared_norm<float>(grads);
      (void)norm;
      ops::adamw_step(ops::AdamWOptions{}, 1, b.p, b.g, b.m, b.v);
      b.g.fill(0.f);
    });
  };
}

struct StreamingRate {
  double bandwidth;  // bytes/s
  std::size_t sizes;
};

// Streaming: what a step streams, cold, charged the elements the step's tasks are charged. Per
// parameter: AdamW (7: value, gradient and two moments read, three written), the gradient norm
// (1) and zeroing the gradients (1); per activation element of a layer: a norm (2), its backward
// (3) and a residual add (3). In the proportion a small model's step has them.
StreamingRate calibrate_streaming(devices::DeviceSet& set, double seconds, Measurements& out) {
  double streamed_bytes = 0, streamed_seconds = 0;
  std::vector<std::pair<std::string, std::pair<double, double>>> streaming;
  struct StreamingSize {
    std::int64_t rows, h, params;
  };
  for (const StreamingSize size : {StreamingSize{1024, 256, 1 << 20}, {2048, 512, 4 << 20}}) {
    const std::int64_t rows = size.rows, h = size.h, params = size.params;
    const double activations = static_cast<double>(rows * h), weights = static_cast<double>(params);
    const int sets = cold_sets(4.0 * (3 * activations + 4 * weights));
    const double t = time_on_devices(set, seconds, streaming_kernel(rows, h, params, sets));
    const double bytes = 4.0 * (8 * activations + 9 * weights);
    streamed_bytes += bytes;
    streamed_seconds += t;
    streaming.push_back(
        {fmt::format("[{}, {}] norm, its backward, add; {} parameters' AdamW, norm, zeroing", rows,
                     h, params),
         {bytes, t}});
  }
  const double bandwidth = streamed_bytes / streamed_seconds;
  for (const auto& [shape, bt] : streaming)
    out.push_back({.kernel = "streaming",
                   .shape = shape,
                   .seconds = bt.second,
                   .modelled_seconds = bt.first / bandwidth});
  return {bandwidth, streaming.size()};
}

// The measured rates as an accelerator preset.
devices::Accelerator host_preset(const CalibrationOptions& options, int cores,
                                 const ProductRates& products, const AttentionRates& attention,
                                 const StreamingRate& streaming) {
  devices::Accelerator a;
  a.name = fmt::format("this host, {} device(s) of {} core(s)", options.devices,
                       std::max(1, cores / options.devices));
  // The fitted product rate is the host's "peak": the efficiencies are then shares of it.
  a.peak_flops = std::max({products.rate, attention.forward, attention.backward});
  a.matmul_efficiency = products.rate / a.peak_flops;
  a.matmul_overhead_dimension = products.overhead;
  a.attention_efficiency = attention.forward / a.peak_flops;
  a.attention_backward_efficiency = attention.backward / a.peak_flops;
  // The backends that run the blockwise kernel on this host (unfused and local materialise the
  // scores: products and streaming), and the one auto chooses.
  for (const char* backend : {"flash", "fused"})
    a.attention_kernels.emplace_back(backend, attention.table);
  a.attention_auto = "flash";
  a.memory_bandwidth = streaming.bandwidth;
  a.memory_efficiency = 1;
  a.memory_bytes = static_cast<std::int64_t>(1) << 30;
  a.devices_per_node = options.devices;
  // Transfers between the devices are copies in shared memory: the virtual clock's host link.
  a.node_link = {.name = "shared memory", .bytes_per_second = 10e9, .latency_us = 1};
  a.network = a.node_link;
  a.sources = {fmt::format(
      "weave calibrate: matrix products over {} shapes (forward and both backward halves), "
      "blockwise attention forward and backward at {} shapes (4 head dimensions by 4 sequence "
      "lengths: attention_kernels' table), a step's streaming (norms, residual "
      "adds, AdamW, the gradient norm) at {} sizes, all from memory beyond the cache, on {} "
      "device(s) side by side",
      products.shapes, attention.shapes, streaming.sizes, options.devices)};
  a.assumed =
      "peak_flops is the fitted rate of large matrix products here (efficiency 1), not a "
      "datasheet figure; memory_bytes (1 GiB) and the shared-memory link (10 GB/s, 1 us) are "
      "placeholders";
  return a;
}

}  // namespace

HostCalibration calibrate_host(const CalibrationOptions& options) {
  check_options(options);
  devices::DeviceSet set(options.devices);
  const double seconds = options.seconds_per_measurement;
  HostCalibration result;
  const ProductRates products = calibrate_products(set, seconds, result.measurements);
  const AttentionRates attention = calibrate_attention(set, seconds, result.measurements);
  const StreamingRate streaming = calibrate_streaming(set, seconds, result.measurements);
  result.preset = host_preset(options, set.topology().cores(), products, attention, streaming);
  return result;
}

}  // namespace weave::graphs
