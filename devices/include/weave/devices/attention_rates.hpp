// An attention kernel's measured rate by head dimension and sequence length, as published kernel
// benchmarks give it (FlashAttention's and cuDNN's TFLOP/s at head dimension 64, 128, 256 and
// sequence lengths 512 to 16k): a fused attention kernel is slower at short sequences, where its
// blocks of queries see few keys and the causal mask's edge blocks weigh more, and its rate differs
// from one kernel to another by more than any flat share of the peak can say.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace weave::devices {

struct AttentionRateTable {
  // The measured rates of one head dimension: (sequence length, FLOP/s) by rising length.
  struct Row {
    double head_dim = 0;
    std::vector<std::pair<double, double>> points;
  };
  std::string kernel;         // the kernel measured, where and how (the figures' source)
  std::vector<Row> forward;   // causal forward, by rising head dimension
  std::vector<Row> backward;  // the backward, by rising head dimension

  // The rate at a head dimension and sequence length: the row of the nearest head dimension (by
  // ratio: 96 takes 128's row over 64's only when nearer in log scale), in it linear in log2 of
  // the sequence length between the two measured lengths around it, the end's rate beyond the
  // measured range. 0 when the direction has no rows.
  double rate(double head_dim, double sequence, bool backward_pass) const;
  bool empty() const { return forward.empty() && backward.empty(); }
};

}  // namespace weave::devices
