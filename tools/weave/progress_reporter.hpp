// What `weave train` shows while it runs: a live progress line on a terminal, plain lines
// otherwise, and JSON lines for machines. The Trainer's callbacks drive it.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

#include "weave/graphs/trainer.hpp"

namespace weave::cli {

class ProgressReporter {
 public:
  // log_json: a file for JSON lines ("" for none). interval: plain lines every this many
  // iterations. shown = false: prints and writes nothing (the processes of a multi-process run
  // other than the first).
  ProgressReporter(std::int64_t total_iterations, int interval, const std::string& log_json,
                   bool shown = true);
  void iteration(const graphs::IterationMetrics& r);
  void validation(std::int64_t iteration, double loss);
  void note(const std::string& text);
  void finish();

 private:
  void clear_line();
  std::int64_t total_;
  int interval_;
  bool terminal_;
  bool line_open_ = false;
  bool shown_ = true;
  std::ofstream json_;
  double tokens_ = 0, seconds_ = 0;
  std::optional<double> exposed_, bubble_;
};

}  // namespace weave::cli
