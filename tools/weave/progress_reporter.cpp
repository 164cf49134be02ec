#include "progress_reporter.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
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

ProgressReporter::ProgressReporter(std::int64_t total, int interval, const std::string& log_json,
                                   bool shown)
    : total_(total),
      interval_(std::max(1, interval)),
      terminal_(isatty(fileno(stdout)) != 0),
      shown_(shown) {
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
  std::string extras = exposed_ ? fmt::format(" | exposed comm {:.0f}%", 100 * *exposed_) : "";
  if (bubble_) extras += fmt::format(" | bubble {:.2f}", *bubble_);
  if (r.dropped_picks && r.routed_picks > 0)
    extras += fmt::format(" | dropped {:.1f}%", 100.0 * static_cast<double>(*r.dropped_picks) /
                                                    static_cast<double>(r.routed_picks));
  if (json_) {
    nlohmann::json j{{"iteration", r.iteration},
                     {"loss", r.loss},
                     {"aux_loss", r.aux_loss},
                     {"grad_norm", r.grad_norm},
                     {"lr", r.learning_rate},
                     {"seconds", r.seconds},
                     {"tokens_per_second", r.seconds > 0 ? tokens / r.seconds : 0.0}};
    if (r.exposed_comm_share) j["exposed_comm_share"] = *r.exposed_comm_share;
    if (r.pipeline_bubble) j["pipeline_bubble"] = *r.pipeline_bubble;
    if (r.dropped_picks) {
      j["dropped_picks"] = *r.dropped_picks;
      j["routed_picks"] = r.routed_picks;
    }
    json_ << j.dump() << "\n" << std::flush;
  }
  if (terminal_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * r.iteration / std::max<std::int64_t>(total_, 1));
    clear_line();
    fmt::print("\riter {}/{} [{}{}] loss {:.4f} | {:.0f} tok/s | ETA {}{}", r.iteration, total_,
               std::string(static_cast<std::size_t>(filled), '='),
               std::string(static_cast<std::size_t>(kWidth - filled), ' '), r.loss, rate,
               clock_text(eta), extras);
    std::fflush(stdout);
    line_open_ = true;
    if (r.iteration % interval_ == 0 || r.iteration == total_) {
      fmt::print("\n");
      line_open_ = false;
    }
  } else if (r.iteration % interval_ == 0 || r.iteration == total_ || r.iteration == 1) {
    fmt::print(
        "iteration {:>6}/{} | loss {:.4f} | aux {:.4f} | grad norm {:.3f} | lr {:.3g} | "
        "{:.0f} tokens/s{}\n",
        r.iteration, total_, r.loss, r.aux_loss, r.grad_norm, r.learning_rate, rate, extras);
    std::fflush(stdout);
  }
}

void ProgressReporter::validation(std::int64_t iteration, double loss) {
  if (!shown_) return;
  clear_line();
  fmt::print("validation at iteration {}: loss {:.4f} (perplexity {:.2f})\n", iteration, loss,
             std::exp(loss));
  if (json_) json_ << nlohmann::json{{"iteration", iteration}, {"valid_loss", loss}}.dump() << "\n";
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
