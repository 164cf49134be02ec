// What `weave train` shows while it runs: a live progress line on a terminal, plain lines
// otherwise, and JSON lines for machines.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

namespace weave::cli {

struct IterationReport {
  std::int64_t iteration = 0;
  double loss = 0;
  double aux_loss = 0;
  double grad_norm = 0;
  double learning_rate = 0;
  double seconds = 0;  // this iteration's time (wall, or modelled with --timing model)
  double tokens = 0;   // tokens it trained on
  std::optional<double> exposed_comm_share;  // when the iteration was traced
  // MoE picks dropped by full experts, and all picks; shown when routing has a capacity.
  std::optional<std::int64_t> dropped_picks;
  std::int64_t routed_picks = 0;
  // Pipeline parallelism: compute idle over busy summed over devices, when traced.
  std::optional<double> pipeline_bubble;
};

class ProgressReporter {
 public:
  // log_json: a file for JSON lines ("" for none). interval: plain lines every this many
  // iterations.
  ProgressReporter(std::int64_t total_iterations, int interval, const std::string& log_json);
  void iteration(const IterationReport& r);
  void validation(std::int64_t iteration, double loss);
  void note(const std::string& text);
  void finish();

 private:
  void clear_line();
  std::int64_t total_;
  int interval_;
  bool terminal_;
  bool line_open_ = false;
  std::ofstream json_;
  double tokens_ = 0, seconds_ = 0;
  std::optional<double> exposed_, bubble_;
};

}  // namespace weave::cli
