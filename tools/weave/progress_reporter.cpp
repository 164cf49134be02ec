#include "progress_reporter.hpp"

#include <fmt/format.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace weave::cli {

namespace {
std::string clock_text(double seconds) {
  const auto s = static_cast<long>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}
}  // namespace

int terminal_columns() {
  if (const char* columns = std::getenv("COLUMNS")) {
    char* end = nullptr;
    const long n = std::strtol(columns, &end, 10);
    if (end != columns && *end == '\0' && n > 0 && n < 100000) return static_cast<int>(n);
  }
  winsize size{};
  if (::ioctl(fileno(stdout), TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  return 80;
}

std::string fit_progress_line(std::int64_t iteration, std::int64_t total, const std::string& text,
                              int columns) {
  // The last column stays empty: a character there makes some terminals wrap.
  const auto room = static_cast<std::size_t>(std::max(columns - 1, 1));
  const std::string head = fmt::format("iter {}/{} ", iteration, total);
  constexpr std::size_t kFullBar = 24, kShortestBar = 5;
  const std::size_t used = head.size() + text.size() + 3;  // "[" bar "] "
  const std::size_t bar = used >= room ? 0 : std::min(kFullBar, room - used);
  std::string line = head;
  if (bar >= kShortestBar) {
    const auto filled =
        static_cast<std::size_t>(static_cast<double>(bar) * static_cast<double>(iteration) /
                                 static_cast<double>(std::max<std::int64_t>(total, 1)));
    const std::size_t done = std::min(filled, bar);
    line += '[';
    line.append(done, '=');
    line.append(bar - done, ' ');
    line += "] ";
  }
  line += text;
  if (line.size() > room) line.resize(room);
  return line;
}

ProgressReporter::ProgressReporter(std::int64_t total, int interval, const std::string& log_json,
                                   bool shown)
    : total_(total),
      interval_(std::max(1, interval)),
      terminal_(isatty(fileno(stdout)) != 0),
      shown_(shown) {
  if (terminal_) columns_ = terminal_columns();
  if (shown_ && !log_json.empty()) {
    json_.open(log_json, std::ios::trunc);
    if (!json_) throw std::runtime_error(fmt::format("--log-json: cannot write '{}'", log_json));
  }
}

void ProgressReporter::clear_line() {
  if (line_open_) {
    fmt::print("\r\033[K");
    line_open_ = false;
  }
}

void ProgressReporter::iteration(const graphs::IterationMetrics& r) {
  if (!shown_) return;
  const auto tokens = static_cast<double>(r.tokens);
  tokens_ += tokens;
  seconds_ += r.seconds;
  if (r.exposed_comm_share) exposed_ = r.exposed_comm_share;
  if (r.pipeline_bubble) bubble_ = r.pipeline_bubble;
  const double rate = seconds_ > 0 ? tokens_ / seconds_ : 0;
  const double eta =
      rate > 0 ? static_cast<double>(total_ - r.iteration) * (tokens_ / r.iteration) / rate : 0;
  std::string extras = samples_ ? fmt::format(" | global batch {} | consumed samples {}",
                                              r.global_batch_size, r.consumed_samples)
                                : "";
  if (exposed_) extras += fmt::format(" | exposed comm {:.0f}%", 100 * *exposed_);
  // Idle over busy compute, the scale of `weave schedule`'s "bubble / ideal".
  if (bubble_)
    extras += fmt::format(
        " | bubble/ideal {:.2f}{}", *bubble_,
        bubble_theory_ ? fmt::format(" (schedule {:.2f})", *bubble_theory_) : std::string());
  // A loss scaler's scale and the iterations it skipped, as Megatron-LM logs them.
  if (r.loss_scale)
    extras += fmt::format(" | loss scale {:.1f} | skipped {}", *r.loss_scale, r.skipped_iterations);
  if (r.dropped_picks && r.routed_picks > 0)
    extras += fmt::format(" | dropped {:.1f}%", 100.0 * static_cast<double>(*r.dropped_picks) /
                                                    static_cast<double>(r.routed_picks));
  if (json_) {
    nlohmann::json j{{"type", "iteration"},
                     {"iteration", r.iteration},
                     {"loss", r.loss},
                     {"aux_loss", r.aux_loss},
                     {"lr", r.learning_rate},
                     {"seconds", r.seconds},
                     {"tokens_per_second", r.seconds > 0 ? tokens / r.seconds : 0.0}};
    // A skipped step has no norm (Megatron-LM's optimizer returns None for it and its log line
    // leaves the field out): its gradients were not finite and were not clipped.
    if (!r.skipped) j["grad_norm"] = r.grad_norm;
    if (samples_) {
      j["global_batch_size"] = r.global_batch_size;
      j["consumed_samples"] = r.consumed_samples;
    }
    if (r.exposed_comm_share) j["exposed_comm_share"] = *r.exposed_comm_share;
    if (r.pipeline_bubble) j["pipeline_bubble"] = *r.pipeline_bubble;
    if (r.loss_scale) {
      j["loss_scale"] = *r.loss_scale;
      j["skipped"] = r.skipped;
      j["skipped_iterations"] = r.skipped_iterations;
    }
    if (r.dropped_picks) {
      j["dropped_picks"] = *r.dropped_picks;
      j["routed_picks"] = r.routed_picks;
    }
    json_ << j.dump() << "\n" << std::flush;
  }
  if (terminal_) {
    clear_line();
    fmt::print("\r{}", fit_progress_line(r.iteration, total_,
                                         fmt::format("loss {:.4f} | {:.0f} tok/s | ETA {}{}",
                                                     r.loss, rate, clock_text(eta), extras),
                                         columns_));
    std::fflush(stdout);
    line_open_ = true;
    if (r.iteration % interval_ == 0 || r.iteration == total_) {
      fmt::print("\n");
      line_open_ = false;
    }
  } else if (r.iteration % interval_ == 0 || r.iteration == total_ || r.iteration == 1) {
    const std::string norm =
        r.skipped ? std::string() : fmt::format(" | grad norm {:.3f}", r.grad_norm);
    fmt::print("iteration {:>6}/{} | loss {:.4f} | aux {:.4f}{} | lr {:.3g} | {:.0f} tokens/s{}\n",
               r.iteration, total_, r.loss, r.aux_loss, norm, r.learning_rate, rate, extras);
    std::fflush(stdout);
  }
}

void ProgressReporter::validation(std::int64_t iteration, double loss) {
  if (!shown_) return;
  clear_line();
  fmt::print("validation at iteration {}: loss {:.4f} (perplexity {:.2f})\n", iteration, loss,
             std::exp(loss));
  if (json_)
    json_ << nlohmann::json{{"type", "validation"}, {"iteration", iteration}, {"valid_loss", loss}}
                 .dump()
          << "\n"
          << std::flush;
}

void ProgressReporter::record(const std::string& type, nlohmann::json fields) {
  if (!shown_ || !json_) return;
  nlohmann::json j{{"type", type}};
  j.update(fields);
  json_ << j.dump() << "\n" << std::flush;
}

void ProgressReporter::note(const std::string& text) {
  if (!shown_) return;
  clear_line();
  fmt::print("{}\n", text);
  std::fflush(stdout);
}

void ProgressReporter::finish() {
  if (!shown_) return;
  clear_line();
}

}  // namespace weave::cli
