// One layer's Ampipe pipeline on one device, drawn from a replayed step: the picture MindSpeed's
// Ampipe documentation draws by hand (the attention, the all-to-alls and the experts of the
// layer's sequence chunks overlapping), here at the times the virtual clock replayed.
#pragma once

#include <string>

#include "weave/runtime/trace.hpp"

namespace weave::graphs {

// Where the time axis sits, for readers that place the boxes: in each panel a time t on the
// replay's clock is drawn at x = kAmpipeFigureLeft + (t - first) * kAmpipeFigurePlotWidth /
// (last - first), first and last the earliest start and the latest end of the panel's tasks.
inline constexpr double kAmpipeFigureLeft = 150;
inline constexpr double kAmpipeFigurePlotWidth = 1420;

struct AmpipeFigureRequest {
  int layer = 0;
  rt::DeviceId device = 0;
  int micro_batch = 0;
};

// The figure as SVG, 1600 px wide: a forward panel and a backward panel (weight gradients and a
// full recomputation's second forward with the backward), each with a lane per stream that the
// layer's tasks of `micro_batch` used on `device` (the compute stream first, then the others by
// first use, named by their streams). Every task is a box (class "task", its id, kind, phase and
// chunk as data- attributes) placed at its replayed start and end and labelled with its kind (its
// name after "L<l>." and "c<k>.") and its phase and chunk ("F0", "B1"; the phase alone outside the
// chunks); colour says what the kind is (attention, router, dispatch, experts, combine, other
// communication). Communication during which the device computes nothing is hatched red (class
// "exposed"). A layer without chunks (no Ampipe, or not an MoE layer) is drawn as one chunk. Throws
// std::invalid_argument naming the devices or the layers there are when `device` ran nothing or no
// task of `layer`.
std::string render_ampipe_figure(const rt::Trace& trace, const AmpipeFigureRequest& request);

}  // namespace weave::graphs
