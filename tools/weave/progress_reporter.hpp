// What `weave train` shows while it runs: a live progress line on a terminal, fitted to its
// width, plain lines otherwise, and typed JSON lines for machines (a "run" record with the whole
// configuration first, an "iteration" or "validation" record as each happens, a "summary" last).
// The Trainer's callbacks drive it.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "weave/graphs/trainer.hpp"

namespace weave::cli {

// The width of the terminal on stdout: COLUMNS when set to a number, else what the terminal
// says (TIOCGWINSZ), else 80.
int terminal_columns();

// The progress line of a terminal `columns` wide: "iter 3/10 [===   ] " + `text`, the bar
// narrowed or left out and then the text cut so that the line never wraps.
std::string fit_progress_line(std::int64_t iteration, std::int64_t total, const std::string& text,
                              int columns);

class ProgressReporter {
 public:
  // log_json: a file for JSON lines ("" for none). interval: plain lines every this many
  // iterations. shown = false: prints and writes nothing (the processes of a multi-process run
  // other than the first).
  ProgressReporter(std::int64_t total_iterations, int interval, const std::string& log_json,
                   bool shown = true);
  // The pipeline schedule's bubble over ideal in theory, shown beside the measured one.
  void set_bubble_theory(double bubble) { bubble_theory_ = bubble; }
  // A run trained by samples (--train-samples): each line also shows the iteration's global
  // batch and the samples consumed, as Megatron-LM's log line does.
  void show_samples() { samples_ = true; }
  // Writes a record of this type ("run", "summary") to the JSON lines.
  void record(const std::string& type, nlohmann::json fields);
  void iteration(const graphs::IterationMetrics& r);
  void validation(std::int64_t iteration, double loss);
  void note(const std::string& text);
  void finish();

 private:
  void clear_line();
  std::int64_t total_;
  int interval_;
  bool terminal_;
  int columns_ = 80;
  bool line_open_ = false;
  bool shown_ = true;
  bool samples_ = false;
  std::ofstream json_;
  double tokens_ = 0, seconds_ = 0;
  std::optional<double> exposed_, bubble_, bubble_theory_;
};

}  // namespace weave::cli
