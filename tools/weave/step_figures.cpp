#include "step_figures.hpp"

#include <fmt/format.h>

#include <fstream>
#include <stdexcept>
#include <vector>

#include "output_paths.hpp"
#include "train_options.hpp"
#include "weave/graphs/ampipe_figure.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/pipeline_replay_figure.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"

namespace weave::cli {

namespace {

// The first device (tp = cp = dp = 0) of the pipeline rank that holds `layer`.
int device_holding(const graphs::TrainerConfig& c, int layer) {
  const graphs::PipelineLayout layout = graphs::make_pipeline_layout(c.model, c.plan);
  int pp = 0;
  for (int k = 0; k < layout.chunks(); ++k)
    if (layout.first_layer(k) <= layer && layer < layout.end_layer(k)) pp = layout.rank_of(k);
  return graphs::Mesh(c.plan).rank_of(0, 0, 0, pp);
}

}  // namespace

FigureRequest figure_request(const TrainOptions& o, const graphs::TrainerConfig& c) {
  FigureRequest r{.kind = o.figure, .path = o.figure_out};
  if (r.kind.empty()) {
    for (const auto& [flag, given] : {std::pair{"--figure-out", !o.figure_out.empty()},
                                      std::pair{"--layer", o.figure_layer >= 0},
                                      std::pair{"--figure-device", o.figure_device >= 0}})
      if (given)
        throw std::invalid_argument(fmt::format(
            "{} shapes --figure's drawing: add --figure ampipe (or --figure pipeline)", flag));
    return r;
  }
  if (r.path.empty()) r.path = r.kind + ".svg";
  check_writable("--figure-out", r.path);
  if (r.kind == "pipeline") {
    if (o.figure_layer >= 0 || o.figure_device >= 0)
      throw std::invalid_argument(fmt::format(
          "{} chooses the Ampipe figure's layer and device; --figure pipeline draws every stage: "
          "leave it out, or use --figure ampipe",
          o.figure_layer >= 0 ? "--layer" : "--figure-device"));
    return r;
  }
  const int layers = c.model.num_layers;
  if (o.figure_layer < 0)
    throw std::invalid_argument(fmt::format(
        "--figure ampipe draws one layer: add --layer L, L from 0 to {} (--num-layers {})",
        layers - 1, layers));
  if (o.figure_layer >= layers)
    throw std::invalid_argument(fmt::format(
        "--layer {} is not a layer of the model: give one from 0 to {} (--num-layers {})",
        o.figure_layer, layers - 1, layers));
  r.layer = o.figure_layer;
  const int devices = c.plan.devices();
  if (o.figure_device >= devices)
    throw std::invalid_argument(fmt::format(
        "--figure-device {} is not a device of the run: give one from 0 to {} ({} devices)",
        o.figure_device, devices - 1, devices));
  r.device = o.figure_device >= 0 ? o.figure_device : device_holding(c, r.layer);
  return r;
}

std::string write_figure(const FigureRequest& r, const rt::Trace& trace,
                         const graphs::TrainerConfig& c) {
  std::string svg;
  std::string what;
  if (r.kind == "ampipe") {
    try {
      svg = graphs::render_ampipe_figure(
          trace, {.layer = r.layer, .device = static_cast<rt::DeviceId>(r.device)});
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(fmt::format("--figure ampipe --layer {} --figure-device {}: {}",
                                              r.layer, r.device, e.what()));
    }
    what = fmt::format("Ampipe figure of layer {} on device {}", r.layer, r.device);
  } else {
    const graphs::Mesh mesh(c.plan);
    const graphs::PipelineSchedule schedule =
        graphs::make_pipeline_layout(c.model, c.plan).schedule;
    const graphs::ScheduleKind kind = graphs::pipeline_schedule_kind(c.plan);
    graphs::ReplayedPipeline pipeline{
        .name = schedule.name,
        .stage_devices = {},
        .chunks = schedule.chunks,
        .layout = schedule.layout,
        .split_backward = kind == graphs::ScheduleKind::ZeroBubbleH1 ||
                          kind == graphs::ScheduleKind::ZeroBubbleV};
    for (int pp = 0; pp < c.plan.pipeline_parallel; ++pp)
      pipeline.stage_devices.push_back(static_cast<rt::DeviceId>(mesh.rank_of(0, 0, 0, pp)));
    svg = graphs::render_replayed_pipeline_svg(trace, pipeline);
    what = fmt::format("pipeline figure of {} stage{}", c.plan.pipeline_parallel,
                       c.plan.pipeline_parallel == 1 ? "" : "s");
  }
  std::ofstream out(r.path, std::ios::trunc);
  out << svg;
  out.close();
  if (!out) throw std::runtime_error(fmt::format("--figure-out: writing '{}' failed", r.path));
  return fmt::format("figure: {} (virtual clock), written to {}", what, r.path);
}

}  // namespace weave::cli
