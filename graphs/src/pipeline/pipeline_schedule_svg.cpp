#include "weave/graphs/pipeline_schedule_svg.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "svg_text.hpp"

namespace weave::graphs {

namespace {

constexpr double kLeft = 70;  // room for the rank labels
constexpr double kTop = 56;   // room for the title
constexpr double kRowHeight = 28;
constexpr double kRowGap = 4;
constexpr double kRight = 20;
constexpr double kMaxPlotWidth = 1800;
constexpr double kFilledPlotWidth = 1510;  // ScheduleSvgOptions::fill_width: the SVG 1600 px wide
constexpr double kUnitWidth = 26;          // pixels per time unit when the step is short

// Colour says the phase (the micro-batch is the number in the box): light blue forwards, dark
// blue full backwards, orange input gradients, green weight gradients.
const char* fill(ActionType type) {
  switch (type) {
    case ActionType::Forward:
      return "#9ecae1";
    case ActionType::BackwardInput:
      return "#fd8d3c";
    case ActionType::Backward:
      return "#3182bd";
    case ActionType::BackwardWeight:
      return "#31a354";
    case ActionType::Idle:
      break;
  }
  return "#fff";
}

bool dark(ActionType type) {
  return type == ActionType::Backward || type == ActionType::BackwardWeight;
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

// A tick spacing of 1, 2 or 5 times a power of ten giving at most 25 ticks (from 1e-6: a
// replayed step's milliseconds may span less than one).
double tick_step(double span) {
  for (double power = 1e-6;; power *= 10)
    for (double mantissa : {1.0, 2.0, 5.0})
      if (span / (mantissa * power) <= 25) return mantissa * power;
}

// Where things go: the time scale and the rows' and the axis's positions.
struct Frame {
  double span = 1;  // the latest end time
  double unit = kUnitWidth;
  double plot_width = 0;
  double axis_y = 0;
  double legend_y = 0;
  double height = 0;

  double x(double t) const { return kLeft + t * unit; }
  static double y(int rank) { return kTop + rank * (kRowHeight + kRowGap); }
};

Frame frame_of(const PipelineSchedule& s, const std::vector<Placed>& cells, bool fill_width) {
  Frame f;
  f.span = fill_width ? 0 : 1;
  for (const Placed& c : cells)
    f.span = std::max(f.span, c.end);
  if (f.span <= 0) f.span = 1;
  f.unit = fill_width ? kFilledPlotWidth / f.span : std::min(kUnitWidth, kMaxPlotWidth / f.span);
  f.plot_width = f.span * f.unit;
  const double rows_bottom = kTop + s.ranks * (kRowHeight + kRowGap);
  f.axis_y = rows_bottom + 4;
  f.legend_y = f.axis_y + 40;
  f.height = f.legend_y + 30;
  return f;
}

// One hatch per chunk after the first, at different angles, so chunks read apart; then the
// white background.
std::string hatches(const PipelineSchedule& s) {
  std::string svg = "<defs>\n";
  for (int c = 1; c < std::max(s.chunks, 2); ++c)
    svg += fmt::format(
        "<pattern id=\"chunk{}\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
        "patternTransform=\"rotate({})\"><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" "
        "stroke=\"#000\" stroke-opacity=\"0.35\" stroke-width=\"2\"/></pattern>\n",
        c, 45 + 90 * (c - 1) / std::max(1, s.chunks - 1));
  svg += "</defs>\n";
  svg += "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n";
  return svg;
}

// The title (name, p, m, v and the bubble) and the checker's first problem under it; `reach` is
// how far right the title goes.
std::string title(const PipelineSchedule& s, const ScheduleReport& report, double& reach) {
  const std::string bubble =
      report.simulated
          ? fmt::format("bubble {:.3f} of the ideal time, {:.1f}% idle, makespan {:g}",
                        report.bubble_over_ideal, 100 * report.idle_over_total, report.makespan)
          : std::string("not simulated");
  const std::string text = fmt::format("{}: p={}, m={}, v={} &#8212; {}", svg_escape(s.name),
                                       s.ranks, s.micro_batches, s.chunks, svg_escape(bubble));
  std::string svg = fmt::format(
      "<text x=\"{}\" y=\"22\" font-size=\"16\" font-weight=\"bold\">{}</text>\n", kLeft, text);
  // Rough text widths: about 0.6 em per character.
  reach = kLeft + 9.6 * static_cast<double>(text.size());
  if (!report.problems.empty())
    svg += fmt::format("<text x=\"{}\" y=\"42\" font-size=\"12\" fill=\"#b00\">{}{}</text>\n",
                       kLeft, svg_escape(report.problems.front()),
                       report.problems.size() > 1
                           ? fmt::format(" (and {} more)", report.problems.size() - 1)
                           : std::string());
  return svg;
}

// Each rank's label and empty row.
std::string rows(const PipelineSchedule& s, const Frame& f) {
  std::string svg;
  for (int r = 0; r < s.ranks; ++r) {
    svg += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" font-size=\"12\" text-anchor=\"end\" "
        "dominant-baseline=\"middle\">rank {}</text>\n",
        kLeft - 8, Frame::y(r) + kRowHeight / 2, r);
    svg += fmt::format(
        "<rect x=\"{}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{}\" fill=\"#f4f4f4\"/>\n", kLeft,
        Frame::y(r), f.plot_width, kRowHeight);
  }
  return svg;
}

// The micro-batch's number (primed for later chunks) in every box, as large as the box allows:
// across it when it fits, else turned upright along the row's height.
std::string number(const Placed& c, double cx, double cw, double cy) {
  const std::string label =
      std::to_string(c.action.micro_batch) +
      std::string(static_cast<std::size_t>(std::max(0, c.action.chunk)), '\'');
  const double chars = static_cast<double>(label.size());
  constexpr double kGlyph = 0.62;  // a digit's width in ems, about
  const double across = std::min(11.0, (cw - 2) / (kGlyph * chars));
  const double upright = std::min({11.0, (kRowHeight - 4) / (kGlyph * chars), cw - 1});
  const bool turned = upright > across && across < 8;
  const double size = std::max(5.0, turned ? upright : across);
  const double mx = cx + cw / 2, my = cy + kRowHeight / 2;
  return fmt::format(
      "<text class=\"micro-batch\" x=\"{:.2f}\" y=\"{:.1f}\" font-size=\"{:.1f}\" "
      "text-anchor=\"middle\" dominant-baseline=\"central\" fill=\"{}\"{}>{}</text>",
      mx, my, size, dark(c.action.type) ? "#fff" : "#000",
      turned ? fmt::format(" transform=\"rotate(-90 {:.2f} {:.1f})\"", mx, my) : "", label);
}

// One action's rectangle with its tooltip, its chunk's hatch and its micro-batch's number.
std::string cell(const PipelineSchedule& s, const Placed& c, const Frame& f) {
  const double cx = f.x(c.start), cw = (c.end - c.start) * f.unit, cy = Frame::y(c.rank);
  std::string svg = fmt::format(
      "<g><title>rank {} step {}: {} (stage {}), time {:g} to {:g}</title>"
      "<rect class=\"action\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" "
      "fill=\"{}\" stroke=\"#333\" stroke-width=\"0.6\"/>",
      c.rank, c.step, to_string(c.action), s.stage(c.rank, c.action.chunk), c.start, c.end, cx, cy,
      cw, kRowHeight, fill(c.action.type));
  if (c.action.chunk > 0)
    svg += fmt::format(
        "<rect class=\"chunk-mark\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" "
        "fill=\"url(#chunk{})\"/>",
        cx, cy, cw, kRowHeight, c.action.chunk);
  svg += number(c, cx, cw, cy);
  svg += "</g>\n";
  return svg;
}

std::string time_axis(const ScheduleReport& report, const Frame& f, const std::string& caption) {
  std::string svg =
      fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#000\"/>\n",
                  kLeft, f.axis_y, f.x(f.span), f.axis_y);
  const double step = tick_step(f.span);
  for (double t = 0; t <= f.span + 1e-9; t += step)
    svg += fmt::format(
        "<line x1=\"{0:.2f}\" y1=\"{1:.1f}\" x2=\"{0:.2f}\" y2=\"{2:.1f}\" stroke=\"#000\"/>"
        "<text x=\"{0:.2f}\" y=\"{3:.1f}\" font-size=\"10\" text-anchor=\"middle\">{4:g}</text>\n",
        f.x(t), f.axis_y, f.axis_y + 4, f.axis_y + 15, t);
  svg +=
      fmt::format("<text x=\"{}\" y=\"{:.1f}\" font-size=\"11\">{}</text>\n", kLeft, f.axis_y + 29,
                  !caption.empty()   ? svg_escape(caption)
                  : report.simulated ? std::string("time (one forward of one chunk = 1 by default)")
                                     : std::string("step (not simulated)"));
  return svg;
}

// The phases' colours, the chunk hatch, and what colour and number mean; `reach` grows to how
// far right the legend goes.
std::string legend(const Frame& f, double& reach) {
  std::string svg;
  double lx = kLeft;
  const auto swatch = [&](const std::string& fill, const std::string& label) {
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"14\" fill=\"{}\" "
        "stroke=\"#333\" stroke-width=\"0.6\"/><text x=\"{:.1f}\" y=\"{:.1f}\" "
        "font-size=\"11\">{}</text>\n",
        lx, f.legend_y, fill, lx + 18, f.legend_y + 11, label);
    lx += 18 + 6.6 * static_cast<double>(label.size()) + 16;
  };
  swatch(fill(ActionType::Forward), "forward");
  swatch(fill(ActionType::Backward), "backward");
  swatch(fill(ActionType::BackwardInput), "input gradient");
  swatch(fill(ActionType::BackwardWeight), "weight gradient");
  swatch("url(#chunk1)", "later chunk (')");
  svg += fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\">colour: phase; number: "
      "micro-batch; blank: bubble</text>\n",
      lx, f.legend_y + 11);
  reach = std::max(reach, lx + 6.6 * 44);
  return svg;
}

}  // namespace

std::string render_schedule_svg(const PipelineSchedule& s, const ScheduleReport& report,
                                const ScheduleSvgOptions& options) {
  const std::vector<Placed> cells = place(s, report);
  const Frame f = frame_of(s, cells, options.fill_width);
  // The body first: the width depends on how far the title and the legend reach.
  double reach = 0;
  std::string svg = hatches(s) + title(s, report, reach) + rows(s, f);
  for (const Placed& c : cells)
    if (c.action.type != ActionType::Idle) svg += cell(s, c, f);
  svg += time_axis(report, f, options.time_axis);
  svg += legend(f, reach);
  const double width = std::max(kLeft + f.plot_width, reach) + kRight;
  return fmt::format(
             "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
             "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
             "viewBox=\"0 0 {:.0f} {:.0f}\" font-family=\"sans-serif\">\n",
             width, f.height, width, f.height) +
         svg + "</svg>\n";
}

}  // namespace weave::graphs
