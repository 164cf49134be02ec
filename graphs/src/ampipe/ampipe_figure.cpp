#include "weave/graphs/ampipe_figure.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

#include "pipeline/svg_text.hpp"

namespace weave::graphs {

namespace {

constexpr double kWidth = 1600;
constexpr double kTop = 64;  // room for the title and its second line
constexpr double kLaneHeight = 34;
constexpr double kLaneGap = 6;
constexpr double kPanelTitle = 26;  // the panel's name above its lanes
constexpr double kAxis = 34;        // the time axis under the lanes
constexpr double kGlyph = 0.6;      // a character's width in ems, about

// What a kind of task is, for its colour: the parts of an Ampipe layer the figure is about.
enum class Role { attention, router, dispatch, experts, combine, communication, other };

struct RoleStyle {
  const char* name;
  const char* fill;
};
constexpr RoleStyle kRoles[] = {
    {"attention", "#6baed6"},           {"router (gate)", "#fdd835"},
    {"dispatch all-to-all", "#fd8d3c"}, {"experts", "#74c476"},
    {"combine all-to-all", "#b39ddb"},  {"other communication (gathers, reductions)", "#f48fb1"},
    {"other compute", "#cfcfcf"}};

Role role_of(std::string_view kind, rt::TaskKind task_kind) {
  const auto has = [&](std::string_view part) { return kind.find(part) != std::string_view::npos; };
  if (task_kind == rt::TaskKind::comm || task_kind == rt::TaskKind::copy) {
    if (has("dispatch")) return Role::dispatch;
    if (has("combine")) return Role::combine;
    return Role::communication;
  }
  if (has("router") || has("gate")) return Role::router;
  if (has("expert") || has("fc1") || has("fc2")) return Role::experts;
  if (has("attention") || has("qkv") || has("norm") || has("proj")) return Role::attention;
  return Role::other;
}

// The task's name after "L<l>." and "c<k>." and without a collective member's "[i]": what it
// does within the layer's chunk.
std::string_view kind_of(std::string_view name) {
  const auto skip = [&](char letter) {
    if (name.size() < 2 || name[0] != letter) return;
    std::size_t at = 1;
    while (at < name.size() && name[at] >= '0' && name[at] <= '9')
      ++at;
    if (at > 1 && at < name.size() && name[at] == '.') name.remove_prefix(at + 1);
  };
  skip('L');
  skip('c');
  // A collective member's index ("[0]") says nothing of what the task does.
  if (name.ends_with(']')) name = name.substr(0, std::min(name.size(), name.rfind('[')));
  return name;
}

struct Box {
  rt::TaskId task;
  rt::StreamId stream;
  rt::Nanos start, end;
  std::string_view kind;
  Role role;
  int chunk;
  rt::Phase phase;
  bool communication;
};

// Parts of [start, end) during which no compute span runs; `compute` is sorted and merged.
std::vector<std::pair<rt::Nanos, rt::Nanos>> uncovered(
    rt::Nanos start, rt::Nanos end, const std::vector<std::pair<rt::Nanos, rt::Nanos>>& compute) {
  std::vector<std::pair<rt::Nanos, rt::Nanos>> out;
  rt::Nanos at = start;
  auto it = std::lower_bound(compute.begin(), compute.end(), std::pair{start, start},
                             [](const auto& a, const auto& b) { return a.second < b.second; });
  for (; it != compute.end() && it->first < end && at < end; ++it) {
    if (it->first > at) out.emplace_back(at, it->first);
    at = std::max(at, it->second);
  }
  if (at < end) out.emplace_back(at, end);
  return out;
}

// The device's compute busy intervals, merged.
std::vector<std::pair<rt::Nanos, rt::Nanos>> compute_busy(const rt::Trace& trace,
                                                          rt::DeviceId device) {
  std::vector<std::pair<rt::Nanos, rt::Nanos>> spans;
  for (const rt::Span& s : trace.spans()) {
    const rt::TaskInfo& t = trace.tasks()[s.task];
    if (t.device == device && t.kind == rt::TaskKind::compute && s.end > s.start)
      spans.emplace_back(s.start, s.end);
  }
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<rt::Nanos, rt::Nanos>> merged;
  for (const auto& s : spans)
    if (!merged.empty() && s.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, s.second);
    else
      merged.push_back(s);
  return merged;
}

std::string ranges_text(const std::set<int>& values) {
  std::string text;
  for (auto it = values.begin(); it != values.end();) {
    const int first = *it;
    int last = first;
    for (++it; it != values.end() && *it == last + 1; ++it)
      last = *it;
    text += (text.empty() ? "" : ", ") +
            (first == last ? std::to_string(first) : fmt::format("{} to {}", first, last));
  }
  return text;
}

// The layer's tasks of the micro-batch on the device, checked against what the trace holds.
std::vector<Box> boxes_of(const rt::Trace& trace, const AmpipeFigureRequest& r) {
  // (An empty trace may hold no task table at all.)
  if (trace.empty())
    throw std::invalid_argument("the step has no replay to draw: replay it on the virtual clock");
  const rt::TaskTable& tasks = trace.tasks();
  std::set<int> devices, layers;
  std::vector<Box> boxes;
  for (const rt::Span& s : trace.spans()) {
    const rt::TaskInfo& t = tasks[s.task];
    devices.insert(static_cast<int>(t.device));
    if (t.device != r.device) continue;
    if (t.tags.layer >= 0) layers.insert(t.tags.layer);
    if (t.tags.layer != r.layer || t.tags.phase == rt::Phase::none) continue;
    if (t.tags.micro_batch != r.micro_batch && t.tags.micro_batch >= 0) continue;
    const std::string_view kind = kind_of(tasks.name(s.task));
    const bool communication = t.kind == rt::TaskKind::comm || t.kind == rt::TaskKind::copy;
    boxes.push_back({s.task, t.stream, s.start, s.end, kind, role_of(kind, t.kind), t.tags.chunk,
                     t.tags.phase, communication});
  }
  if (!devices.contains(static_cast<int>(r.device)))
    throw std::invalid_argument(
        fmt::format("device {} ran no task of the replayed step; its "
                    "devices are {}: choose one of them",
                    r.device, ranges_text(devices)));
  if (boxes.empty())
    throw std::invalid_argument(fmt::format(
        "layer {} has no task of micro-batch {} on device {}, which runs layer{} {}: choose one "
        "of them, or the device of the pipeline stage that holds layer {}",
        r.layer, r.micro_batch, r.device, layers.size() == 1 ? "" : "s", ranges_text(layers),
        r.layer));
  return boxes;
}

// A tick spacing of 1, 2 or 5 times a power of ten giving at most 12 ticks.
double tick_step(double span) {
  for (double power = 1;; power *= 10)
    for (const double mantissa : {1.0, 2.0, 5.0})
      if (span / (mantissa * power) <= 12) return mantissa * power;
}

std::string phase_label(const Box& b) {
  const std::string_view phase = rt::to_string(b.phase);
  return b.chunk >= 0 ? fmt::format("{}{}", phase, b.chunk) : std::string(phase);
}

// A label inside a box as large as the box allows (up to 11 px), or nothing when it cannot be
// read (under 5 px); the chunk's label is tried alone when the kind does not fit beside it.
std::string box_label(const Box& b, double x, double w, double y) {
  const std::string chunk = phase_label(b);
  const std::string full = fmt::format("{} {}", b.kind, chunk);
  const auto size_for = [&](const std::string& text) {
    return std::min(11.0, (w - 3) / (kGlyph * static_cast<double>(text.size())));
  };
  std::string text = full;
  double size = size_for(full);
  if (size < 7) {
    // The kind cut short at 8 px ("combi… F0") while four of its letters fit, else the chunk alone.
    const auto fits = static_cast<std::size_t>(std::max(0.0, (w - 3) / (kGlyph * 8)));
    if (fits >= chunk.size() + 6) {
      text = fmt::format("{}\u2026 {}", b.kind.substr(0, fits - chunk.size() - 2), chunk);
      size = 8;
    } else {
      text = chunk;
      size = size_for(chunk);
    }
  }
  if (size < 5) return {};
  return fmt::format(
      "<text class=\"label\" x=\"{:.2f}\" y=\"{:.1f}\" font-size=\"{:.1f}\" "
      "text-anchor=\"middle\" dominant-baseline=\"central\">{}</text>",
      x + w / 2, y + kLaneHeight / 2, size, svg_escape(text));
}

struct Panel {
  const char* name;
  std::vector<const Box*> boxes;
  std::vector<rt::StreamId> lanes;  // compute first, then by first use
  rt::Nanos first = 0, last = 1;
};

// Whether each box is a forward task run a second time (a full recomputation's forward, within
// the backward, its tasks named as the first forward's): a forward whose name an earlier forward
// task already has.
std::vector<bool> recomputed(const std::vector<Box>& boxes, const rt::TaskTable& tasks) {
  std::vector<std::size_t> order(boxes.size());
  for (std::size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::pair(boxes[a].start, boxes[a].task) < std::pair(boxes[b].start, boxes[b].task);
  });
  std::set<std::string_view> seen;
  std::vector<bool> again(boxes.size(), false);
  for (const std::size_t i : order)
    if (boxes[i].phase == rt::Phase::forward)
      again[i] = !seen.insert(tasks.name(boxes[i].task)).second;
  return again;
}

// The forward panel holds the first forward; the backward panel the rest: the backward, the
// weight gradients and a recomputation's second forward, which runs within the backward.
Panel panel_of(const char* name, const std::vector<Box>& boxes, const std::vector<bool>& again,
               bool forward) {
  Panel p{name, {}, {}, 0, 1};
  for (std::size_t i = 0; i < boxes.size(); ++i)
    if ((boxes[i].phase == rt::Phase::forward && !again[i]) == forward)
      p.boxes.push_back(&boxes[i]);
  std::sort(p.boxes.begin(), p.boxes.end(), [](const Box* a, const Box* b) {
    return std::pair(a->start, a->task) < std::pair(b->start, b->task);
  });
  if (p.boxes.empty()) return p;
  p.first = p.boxes.front()->start;
  p.last = p.first + 1;
  bool compute = false;
  for (const Box* b : p.boxes) {
    p.last = std::max(p.last, b->end);
    compute = compute || b->stream == rt::kComputeStream;
  }
  if (compute) p.lanes.push_back(rt::kComputeStream);
  for (const Box* b : p.boxes)
    if (std::find(p.lanes.begin(), p.lanes.end(), b->stream) == p.lanes.end())
      p.lanes.push_back(b->stream);
  return p;
}

double ms(rt::Nanos t) {
  return static_cast<double>(t) * 1e-6;
}

// The panel's lanes, boxes, exposed hatches and time axis, from `top`; returns its height.
double draw_panel(std::string& svg, const Panel& p, const rt::Trace& trace, double top,
                  const std::vector<std::pair<rt::Nanos, rt::Nanos>>& compute) {
  const double span = static_cast<double>(p.last - p.first);
  const auto x = [&](rt::Nanos t) {
    return kAmpipeFigureLeft + static_cast<double>(t - p.first) * kAmpipeFigurePlotWidth / span;
  };
  svg += fmt::format(
      "<text class=\"panel\" x=\"{}\" y=\"{:.1f}\" font-size=\"14\" font-weight=\"bold\">{} "
      "({} tasks, {:.3f} ms from {:.3f} ms)</text>\n",
      kAmpipeFigureLeft, top + 16, p.name, p.boxes.size(), ms(p.last - p.first), ms(p.first));
  const double lanes_top = top + kPanelTitle;
  const auto lane_y = [&](rt::StreamId stream) {
    const auto at = std::find(p.lanes.begin(), p.lanes.end(), stream) - p.lanes.begin();
    return lanes_top + static_cast<double>(at) * (kLaneHeight + kLaneGap);
  };
  for (const rt::StreamId s : p.lanes) {
    svg += fmt::format(
        "<text class=\"lane\" x=\"{}\" y=\"{:.1f}\" font-size=\"12\" text-anchor=\"end\" "
        "dominant-baseline=\"middle\">{}</text>\n",
        kAmpipeFigureLeft - 8, lane_y(s) + kLaneHeight / 2,
        svg_escape(trace.tasks().stream_name(s)));
    svg +=
        fmt::format("<rect x=\"{}\" y=\"{:.1f}\" width=\"{}\" height=\"{}\" fill=\"#f4f4f4\"/>\n",
                    kAmpipeFigureLeft, lane_y(s), kAmpipeFigurePlotWidth, kLaneHeight);
  }
  for (const Box* b : p.boxes) {
    const double bx = x(b->start), bw = x(b->end) - bx, by = lane_y(b->stream);
    svg += fmt::format(
        "<g><title>{} ({}, {:.3f} ms to {:.3f} ms)</title><rect class=\"task\" data-task=\"{}\" "
        "data-kind=\"{}\" data-phase=\"{}\" data-chunk=\"{}\" x=\"{:.2f}\" y=\"{:.1f}\" "
        "width=\"{:.2f}\" height=\"{}\" fill=\"{}\" stroke=\"#333\" stroke-width=\"0.5\"/>",
        svg_escape(trace.tasks().name(b->task)), svg_escape(trace.tasks().stream_name(b->stream)),
        ms(b->start), ms(b->end), b->task, svg_escape(b->kind), rt::to_string(b->phase), b->chunk,
        bx, by, bw, kLaneHeight, kRoles[static_cast<int>(b->role)].fill);
    if (b->communication)
      for (const auto& [from, to] : uncovered(b->start, b->end, compute))
        svg += fmt::format(
            "<rect class=\"exposed\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" "
            "fill=\"url(#exposed)\" stroke=\"#d62728\" stroke-width=\"1.5\"/>",
            x(from), by, x(to) - x(from), kLaneHeight);
    svg += box_label(*b, bx, bw, by) + "</g>\n";
  }
  const double axis_y =
      lanes_top + static_cast<double>(p.lanes.size()) * (kLaneHeight + kLaneGap) + 2;
  svg += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#000\"/>\n",
                     kAmpipeFigureLeft, axis_y, kAmpipeFigureLeft + kAmpipeFigurePlotWidth, axis_y);
  // Ticks in microseconds from the panel's start.
  const double micros = span * 1e-3;
  const double step = tick_step(micros);
  for (double t = 0; t <= micros + 1e-9; t += step) {
    const double tx = kAmpipeFigureLeft + t / micros * kAmpipeFigurePlotWidth;
    svg += fmt::format(
        "<line x1=\"{0:.2f}\" y1=\"{1:.1f}\" x2=\"{0:.2f}\" y2=\"{2:.1f}\" stroke=\"#000\"/>"
        "<text x=\"{0:.2f}\" y=\"{3:.1f}\" font-size=\"10\" text-anchor=\"middle\">{4:g}</text>\n",
        tx, axis_y, axis_y + 4, axis_y + 15, t);
  }
  svg += fmt::format(
      "<text x=\"{}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\">µs from the panel's "
      "start</text>\n",
      kAmpipeFigureLeft - 8, axis_y + 15);
  return kPanelTitle + static_cast<double>(p.lanes.size()) * (kLaneHeight + kLaneGap) + kAxis;
}

std::string legend(double y) {
  std::string svg;
  double lx = kAmpipeFigureLeft;
  const auto swatch = [&](const std::string& fill, std::string_view label, const char* stroke) {
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"14\" height=\"14\" fill=\"{}\" stroke=\"{}\"/>"
        "<text class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\">{}</text>\n",
        lx, y, fill, stroke, lx + 18, y + 11, svg_escape(label));
    lx += 18 + 6.2 * static_cast<double>(label.size()) + 14;
  };
  for (const RoleStyle& r : kRoles)
    swatch(r.fill, r.name, "#333");
  swatch("url(#exposed)", "exposed (no compute meanwhile)", "#d62728");
  svg += fmt::format(
      "<text x=\"{}\" y=\"{:.1f}\" font-size=\"11\">label: the task's kind, then F/B/W (forward, "
      "backward, weight gradient) and its Ampipe chunk</text>\n",
      kAmpipeFigureLeft, y + 32);
  return svg;
}

}  // namespace

std::string render_ampipe_figure(const rt::Trace& trace, const AmpipeFigureRequest& r) {
  const std::vector<Box> boxes = boxes_of(trace, r);
  std::set<int> chunks;
  for (const Box& b : boxes)
    if (b.chunk >= 0) chunks.insert(b.chunk);
  const auto compute = compute_busy(trace, r.device);
  rt::Nanos communication = 0, exposed = 0;
  for (const Box& b : boxes)
    if (b.communication) {
      communication += b.end - b.start;
      for (const auto& [from, to] : uncovered(b.start, b.end, compute))
        exposed += to - from;
    }
  const std::string chunk_text =
      chunks.empty()
          ? std::string(
                "one chunk: the layer is not split (no Ampipe, or not an MoE "
                "layer)")
          : fmt::format("{} Ampipe chunk{}", chunks.size(), chunks.size() == 1 ? "" : "s");
  std::string body = fmt::format(
      "<text x=\"{}\" y=\"22\" font-size=\"16\" font-weight=\"bold\">Layer {} on device {}, "
      "micro-batch {}: {} (virtual clock)</text>\n"
      "<text x=\"{}\" y=\"42\" font-size=\"12\">communication {:.3f} ms, of which {:.3f} ms "
      "exposed (the device computing nothing meanwhile)</text>\n",
      kAmpipeFigureLeft, r.layer, r.device, r.micro_batch, svg_escape(chunk_text),
      kAmpipeFigureLeft, ms(communication), ms(exposed));
  double y = kTop;
  const std::vector<bool> again = recomputed(boxes, trace.tasks());
  for (const bool forward : {true, false}) {
    const Panel p = panel_of(forward ? "Forward" : "Backward", boxes, again, forward);
    if (p.boxes.empty()) continue;
    y += draw_panel(body, p, trace, y, compute) + 10;
  }
  body += legend(y);
  const double height = y + 50;
  return fmt::format(
             "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
             "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" "
             "viewBox=\"0 0 {0:.0f} {1:.0f}\" font-family=\"sans-serif\">\n"
             "<defs><pattern id=\"exposed\" width=\"6\" height=\"6\" "
             "patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\"><line x1=\"0\" "
             "y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#d62728\" stroke-width=\"2\"/></pattern></defs>\n"
             "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n",
             kWidth, height) +
         body + "</svg>\n";
}

}  // namespace weave::graphs
