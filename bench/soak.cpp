// soak: trains the demo configuration (tools/demo: 4 devices, tensor + sequence, data and expert
// parallelism, Ampipe degree 2, on the fortunes text) for many iterations, evaluating and saving
// checkpoints on the way, and records the process's resident memory and the tokens/s of every
// window of iterations. A long run must neither grow nor slow down: the memory after the first
// window is the baseline every later window must stay within, and the later windows' rate must
// stay near the early ones'. Prints one line per window and exits 1 naming a check that failed.
//
//   soak [--iterations 2000] [--window 100] [--data-path PATH] [--json FILE]
#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "demo_config.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/trainer.hpp"

namespace {

using namespace weave::graphs;

// Memory may settle a little after the first window (allocator caches, the first checkpoint's
// buffers); more than this is growth.
constexpr double kMemoryGrowthShare = 0.05;
constexpr double kMemoryGrowthFloorMiB = 16;
// The machine is shared: a window may be slowed by someone else's work. Slowdown is the late
// windows' median rate below this share of the early windows' median.
constexpr double kSlowestRateShare = 0.75;

// Resident memory of this process in MiB (/proc/self/statm: pages, the second field).
double resident_mib() {
  std::ifstream statm("/proc/self/statm");
  long long size = 0, resident = 0;
  statm >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) /
         (1024.0 * 1024.0);
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// tools/demo's run: its model and plan, and its evaluation, logging and checkpoints.
TrainerConfig demo_config(std::int64_t iterations, const std::string& checkpoint) {
  TrainerConfig c = weave::bench::demo_config(iterations);
  c.eval_interval = 150;
  c.eval_iters = 2;
  c.metrics_interval = 30;
  c.save_path = checkpoint;
  c.save_interval = 500;
  return c;
}

struct Window {
  std::int64_t last_iteration = 0;
  double resident_mib = 0;
  double tokens_per_second = 0;
  double loss = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::int64_t iterations = 2000;
  int window = 100;
  // The Debian package `fortunes` (installed by tools/dev) puts its text here.
  std::string data_path = "/usr/share/games/fortunes";
  std::string json_path;
  CLI::App app{"soak: train the demo configuration long and check memory and speed stay flat"};
  app.add_option("--iterations", iterations)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--window", window, "Iterations per measurement")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--data-path", data_path, "Training text")->capture_default_str();
  app.add_option("--json", json_path, "Also write each window as a JSON line here");
  CLI11_PARSE(app, argc, argv);
  if (iterations < 3 * window) {
    fmt::print(stderr, "soak: --iterations must be at least 3 windows ({})\n", 3 * window);
    return 2;
  }

  const std::string checkpoint =
      (std::filesystem::temp_directory_path() / fmt::format("weave-soak-{}.ckpt", ::getpid()))
          .string();
  TrainerConfig config = demo_config(iterations, checkpoint);
  Trainer trainer(config, TrainingData::from(
                              TokenDataset::from_text(data_path, config.model.seq_length, 0.05)));
  std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");

  std::vector<Window> windows;
  double seconds = 0;
  std::int64_t tokens = 0;
  fmt::print("{:>10} {:>12} {:>10} {:>8}\n", "iteration", "RSS (MiB)", "tokens/s", "loss");
  trainer.run({.iteration = [&](const IterationMetrics& m) {
    seconds += m.seconds;
    tokens += m.tokens;
    if (m.iteration % window != 0) return TrainingControl::proceed;
    const Window w{m.iteration, resident_mib(), static_cast<double>(tokens) / seconds, m.loss};
    windows.push_back(w);
    fmt::print("{:>10} {:>12.1f} {:>10.0f} {:>8.4f}\n", w.last_iteration, w.resident_mib,
               w.tokens_per_second, w.loss);
    std::fflush(stdout);
    if (json)
      fmt::print(json,
                 "{{\"iteration\": {}, \"rss_mib\": {:.2f}, \"tokens_per_second\": {:.1f}, "
                 "\"loss\": {:.6f}}}\n",
                 w.last_iteration, w.resident_mib, w.tokens_per_second, w.loss);
    seconds = 0;
    tokens = 0;
    return TrainingControl::proceed;
  }});
  if (json) std::fclose(json);
  std::filesystem::remove(checkpoint);

  // Memory: every window after the first within the allowance over the first.
  const double baseline = windows.front().resident_mib;
  const double allowed = baseline + std::max(kMemoryGrowthFloorMiB, kMemoryGrowthShare * baseline);
  double highest = baseline;
  for (const Window& w : windows)
    highest = std::max(highest, w.resident_mib);
  // Speed: the first window warms up; compare the next third of the windows with the last third.
  const std::size_t third = (windows.size() - 1) / 3;
  std::vector<double> early, late;
  for (std::size_t i = 1; i <= third; ++i)
    early.push_back(windows[i].tokens_per_second);
  for (std::size_t i = windows.size() - third; i < windows.size(); ++i)
    late.push_back(windows[i].tokens_per_second);
  const double early_rate = median(early), late_rate = median(late);

  fmt::print(
      "memory: {:.1f} MiB after the first window, at most {:.1f} MiB later (allowed {:.1f})\n"
      "speed: median {:.0f} tokens/s in windows 2-{}, {:.0f} in the last {} ({:.0f} %)\n",
      baseline, highest, allowed, early_rate, third + 1, late_rate, third,
      100.0 * late_rate / early_rate);
  bool ok = true;
  if (highest > allowed) {
    fmt::print("soak: FAILED: resident memory grew from {:.1f} MiB to {:.1f} MiB\n", baseline,
               highest);
    ok = false;
  }
  if (late_rate < kSlowestRateShare * early_rate) {
    fmt::print("soak: FAILED: the last windows ran at {:.0f} % of the early ones' speed\n",
               100.0 * late_rate / early_rate);
    ok = false;
  }
  if (ok) fmt::print("soak: passed\n");
  return ok ? 0 : 1;
}
