#include "weave/graphs/pipeline_schedule_svg.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace weave::graphs {

namespace {

constexpr double kLeft = 70;  // room for the rank labels
constexpr double kTop = 56;   // room for the title
constexpr double kRowHeight = 28;
constexpr double kRowGap = 4;
constexpr double kRight = 20;
constexpr double kMaxPlotWidth = 1800;
constexpr double kUnitWidth = 26;  // pixels per time unit when the step is short

std::string escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Neighbouring micro-batches get far-apart hues (steps of the golden angle).
double hue(int micro_batch) {
  return std::fmod(micro_batch * 137.508, 360.0);
}

double lightness(ActionType type) {
  switch (type) {
    case ActionType::Forward:
      return 82;
    case ActionType::BackwardInput:
      return 58;
    case ActionType::Backward:
      return 40;
    case ActionType::BackwardWeight:
      return 28;
    case ActionType::Idle:
      break;
  }
  return 100;
}

struct Placed {
  int rank;
  int step;
  Action action;
  double start;
  double end;
};

// Simulated times when there are some, else one unit per step.
std::vector<Placed> place(const PipelineSchedule& s, const ScheduleReport& report) {
  std::vector<Placed> out;
  for (int r = 0; r < s.ranks && r < static_cast<int>(s.actions.size()); ++r) {
    if (report.simulated) {
      for (const TimedAction& t : report.timeline[r])
        out.push_back({r, t.step, t.action, t.start, t.end});
    } else {
      for (int i = 0; i < static_cast<int>(s.actions[r].size()); ++i)
        out.push_back({r, i, s.actions[r][i], static_cast<double>(i), i + 1.0});
    }
  }
  return out;
}

// A tick spacing of 1, 2 or 5 times a power of ten giving at most 25 ticks.
double tick_step(double span) {
  for (double power = 1;; power *= 10)
    for (double mantissa : {1.0, 2.0, 5.0})
      if (span / (mantissa * power) <= 25) return mantissa * power;
}

}  // namespace

std::string render_schedule_svg(const PipelineSchedule& s, const ScheduleReport& report) {
  const std::vector<Placed> cells = place(s, report);
  double span = 1;
  for (const Placed& c : cells)
    span = std::max(span, c.end);
  const double unit = std::min(kUnitWidth, kMaxPlotWidth / span);
  const double plot_width = span * unit;
  const double rows_bottom = kTop + s.ranks * (kRowHeight + kRowGap);
  const double axis_y = rows_bottom + 4;
  const double legend_y = axis_y + 40;
  const double height = legend_y + 30;
  const auto x = [&](double t) { return kLeft + t * unit; };
  const auto y = [&](int rank) { return kTop + rank * (kRowHeight + kRowGap); };

  // The body first: the width depends on how far the title and the legend reach.
  std::string svg;
  // One hatch per chunk after the first, at different angles, so chunks read apart.
  svg += "<defs>\n";
  for (int c = 1; c < std::max(s.chunks, 2); ++c)
    svg += fmt::format(
        "<pattern id=\"chunk{}\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
        "patternTransform=\"rotate({})\"><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" "
        "stroke=\"#000\" stroke-opacity=\"0.35\" stroke-width=\"2\"/></pattern>\n",
        c, 45 + 90 * (c - 1) / std::max(1, s.chunks - 1));
  svg += "</defs>\n";
  svg += "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n";

  const std::string bubble =
      report.simulated
          ? fmt::format("bubble {:.3f} of the ideal time, {:.1f}% idle, makespan {:g}",
                        report.bubble_over_ideal, 100 * report.idle_over_total, report.makespan)
          : std::string("not simulated");
  const std::string title = fmt::format("{}: p={}, m={}, v={} &#8212; {}", escape(s.name), s.ranks,
                                        s.micro_batches, s.chunks, escape(bubble));
  svg += fmt::format("<text x=\"{}\" y=\"22\" font-size=\"16\" font-weight=\"bold\">{}</text>\n",
                     kLeft, title);
  // Rough text widths: about 0.6 em per character.
  double reach = kLeft + 9.6 * static_cast<double>(title.size());
  if (!report.problems.empty())
    svg += fmt::format("<text x=\"{}\" y=\"42\" font-size=\"12\" fill=\"#b00\">{}{}</text>\n",
                       kLeft, escape(report.problems.front()),
                       report.problems.size() > 1
                           ? fmt::format(" (and {} more)", report.problems.size() - 1)
                           : std::string());

  for (int r = 0; r < s.ranks; ++r) {
    svg += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" font-size=\"12\" text-anchor=\"end\" "
        "dominant-baseline=\"middle\">rank {}</text>\n",
        kLeft - 8, y(r) + kRowHeight / 2, r);
    svg += fmt::format(
        "<rect x=\"{}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{}\" fill=\"#f4f4f4\"/>\n", kLeft,
        y(r), plot_width, kRowHeight);
  }
  for (const Placed& c : cells) {
    if (c.action.type == ActionType::Idle) continue;
    const double cx = x(c.start), cw = (c.end - c.start) * unit, cy = y(c.rank);
    const double l = lightness(c.action.type);
    svg += fmt::format(
        "<g><title>rank {} step {}: {} (stage {}), time {:g} to {:g}</title>"
        "<rect class=\"action\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" "
        "fill=\"hsl({:.0f},65%,{:.0f}%)\" stroke=\"#333\" stroke-width=\"0.6\"/>",
        c.rank, c.step, to_string(c.action), s.stage(c.rank, c.action.chunk), c.start, c.end, cx,
        cy, cw, kRowHeight, hue(c.action.micro_batch), l);
    if (c.action.chunk > 0)
      svg += fmt::format(
          "<rect class=\"chunk-mark\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" "
          "fill=\"url(#chunk{})\"/>",
          cx, cy, cw, kRowHeight, c.action.chunk);
    // A label wider than its cell would spill over the neighbours: the tooltip still names it.
    const std::string label = to_string(c.action);
    if (cw >= 6.0 * static_cast<double>(label.size()) + 2)
      svg += fmt::format(
          "<text x=\"{:.2f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"middle\" "
          "dominant-baseline=\"middle\" fill=\"{}\">{}</text>",
          cx + cw / 2, cy + kRowHeight / 2, l > 60 ? "#000" : "#fff", escape(label));
    svg += "</g>\n";
  }

  // Time axis.
  svg +=
      fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#000\"/>\n",
                  kLeft, axis_y, x(span), axis_y);
  const double step = tick_step(span);
  for (double t = 0; t <= span + 1e-9; t += step)
    svg += fmt::format(
        "<line x1=\"{0:.2f}\" y1=\"{1:.1f}\" x2=\"{0:.2f}\" y2=\"{2:.1f}\" stroke=\"#000\"/>"
        "<text x=\"{0:.2f}\" y=\"{3:.1f}\" font-size=\"10\" text-anchor=\"middle\">{4:g}</text>\n",
        x(t), axis_y, axis_y + 4, axis_y + 15, t);
  svg += fmt::format(
      "<text x=\"{}\" y=\"{:.1f}\" font-size=\"11\">{}</text>\n", kLeft, axis_y + 29,
      report.simulated ? "time (one forward of one chunk = 1 by default)" : "step (not simulated)");

  // Legend: action kinds in a neutral hue, the chunk hatch, and what colour means.
  double lx = kLeft;
  const auto swatch = [&](const std::string& fill, const std::string& label) {
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"14\" fill=\"{}\" "
        "stroke=\"#333\" stroke-width=\"0.6\"/><text x=\"{:.1f}\" y=\"{:.1f}\" "
        "font-size=\"11\">{}</text>\n",
        lx, legend_y, fill, lx + 18, legend_y + 11, label);
    lx += 18 + 6.6 * static_cast<double>(label.size()) + 16;
  };
  swatch(fmt::format("hsl(210,65%,{:.0f}%)", lightness(ActionType::Forward)), "F forward");
  swatch(fmt::format("hsl(210,65%,{:.0f}%)", lightness(ActionType::Backward)), "B backward");
  swatch(fmt::format("hsl(210,65%,{:.0f}%)", lightness(ActionType::BackwardInput)),
         "I input gradient");
  swatch(fmt::format("hsl(210,65%,{:.0f}%)", lightness(ActionType::BackwardWeight)),
         "W weight gradient");
  swatch("url(#chunk1)", "later chunk (')");
  svg += fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\">colour: micro-batch; blank: "
      "bubble</text>\n",
      lx, legend_y + 11);
  reach = std::max(reach, lx + 6.6 * 34);
  const double width = std::max(kLeft + plot_width, reach) + kRight;
  return fmt::format(
             "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
             "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
             "viewBox=\"0 0 {:.0f} {:.0f}\" font-family=\"sans-serif\">\n",
             width, height, width, height) +
         svg + "</svg>\n";
}

}  // namespace weave::graphs
