// Where a builder stands while it emits tasks, passed along as a value: the micro-batch, the
// model chunk and the activation and output sets its tasks use. Nothing of it is kept between
// calls.
#pragma once

#include <cstdint>

#include "weave/runtime/types.hpp"

namespace weave::graphs {

struct BuildPosition {
  int micro_batch = 0;
  int chunk = 0;           // the model chunk (the tasks' virtual stage when there are several)
  int set = 0;             // the activation set the chunk's forward filled
  int output = 0;          // the output set (the last chunk's loss buffers)
  bool tag_chunk = false;  // whether tasks carry the chunk as their virtual stage
  // Full recomputation's second forward, run in the backward: it writes the layer's saved state
  // again, but the step's totals (aux losses, routed and dropped picks) were counted by the
  // first forward and are not counted twice.
  bool recomputing = false;

  rt::TaskTags tags(rt::Phase phase, int layer = -1) const {
    return {.layer = layer,
            .micro_batch = micro_batch,
            .virtual_stage = tag_chunk ? chunk : -1,
            .phase = phase};
  }
  // The tags of a task of one Ampipe chunk (chunk -1: the layer is not split into chunks), which
  // --graph-filter chunk=C and the traces select by.
  rt::TaskTags chunk_tags(rt::Phase phase, int layer, int chunk) const {
    rt::TaskTags t = tags(phase, layer);
    t.chunk = chunk;
    return t;
  }
};

}  // namespace weave::graphs
