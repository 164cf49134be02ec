// One backward mechanism: every layer's backward is an input half (the gradient of its input,
// which the layer below waits for) followed by a weight half (its parameters' gradients, which
// nothing in the backward waits for). Where a weight half goes is the caller's choice:
//
//   immediate    right after its input half: folded into the input half's last task, or as a
//                task of its own that runs while the input gradient is being reduced;
//   deferred     held until the caller flushes it, under a later layer's collective (without
//                tp and cp nothing else would overlap it);
//   zero_bubble  held for the schedule's W action; the input half keeps copies of the output
//                gradients the weight half reads, as the workspace is reused meanwhile.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "weave/runtime/types.hpp"

namespace weave::graphs {

enum class WeightPlacement { immediate, deferred, zero_bubble };

// Emits a weight half's tasks and returns the last of them.
using WeightHalf = std::function<rt::TaskId()>;

// A weight half held for the W action, with the layer it writes the gradients of (-1 for none):
// under ZeRO stage 2 the W action takes that layer's gradient slot for it.
struct LayerWeightHalf {
  int layer = -1;
  WeightHalf emit;
};

// The weight halves of one backward action, held where the caller put them.
class WeightHalves {
 public:
  // zero_bubble: the action is a zero-bubble schedule's I, whose weight halves wait for its W.
  explicit WeightHalves(bool zero_bubble) : zero_bubble_(zero_bubble) {}

  bool zero_bubble() const { return zero_bubble_; }
  // The placement of a weight half that would run right after its input half.
  WeightPlacement immediate() const {
    return zero_bubble_ ? WeightPlacement::zero_bubble : WeightPlacement::immediate;
  }
  // The placement of one a caller would rather run under a later collective.
  WeightPlacement deferrable() const {
    return zero_bubble_ ? WeightPlacement::zero_bubble : WeightPlacement::deferred;
  }

  // Emits `half` now or holds it, as `placement` says; returns its last task if emitted now.
  rt::TaskId place(WeightPlacement placement, WeightHalf half) {
    switch (placement) {
      case WeightPlacement::immediate:
        return half();
      case WeightPlacement::deferred:
        deferred_.push_back(std::move(half));
        break;
      case WeightPlacement::zero_bubble:
        for_w_.push_back({layer_, std::move(half)});
        break;
    }
    return rt::kNoTask;
  }
  // Emits the deferred halves: the caller has just launched a collective they can run under.
  void flush() {
    std::vector<WeightHalf> due = std::move(deferred_);
    deferred_.clear();
    for (const WeightHalf& emit : due)
      emit();
  }
  // The layer whose backward places the halves from now on (-1: none, the model's ends).
  void at_layer(int layer) { layer_ = layer; }
  // The halves the W action emits, in the order they were placed.
  std::vector<LayerWeightHalf> take_for_w() { return std::exchange(for_w_, {}); }

 private:
  bool zero_bubble_;
  int layer_ = -1;
  std::vector<WeightHalf> deferred_;
  std::vector<LayerWeightHalf> for_w_;
};

}  // namespace weave::graphs
