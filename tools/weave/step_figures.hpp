// What `weave train` and `weave predict` draw of a step's replay (--figure): one layer's Ampipe
// pipeline on one device, or the pipeline schedule every stage ran, as SVG.
#pragma once

#include <string>

#include "weave/graphs/trainer_config.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::cli {

struct TrainOptions;

// The flags read and checked before any work starts (std::invalid_argument naming the flag and
// the fix): the figure's kind, its layer within the model, its device within the plan and its
// file. kind is empty when no figure is asked for.
struct FigureRequest {
  std::string kind;  // "ampipe" or "pipeline"
  std::string path;
  int layer = 0;
  int device = 0;
};
FigureRequest figure_request(const TrainOptions& o, const graphs::TrainerConfig& config);

// Draws the figure of `trace` (the virtual-clock replay of `config`'s step) into request.path;
// returns what to tell the user ("figure: ..., written to PATH").
std::string write_figure(const FigureRequest& request, const rt::Trace& trace,
                         const graphs::TrainerConfig& config);

}  // namespace weave::cli
