// What a device's kernels sustain, by kind: the virtual clock's kernel model. A compute task's
// kernels run one after another, so its time is the sum of its kinds' times:
//
//   matrix products  (flops - attention_flops + overhead_dimension x matmul_edges) / matmul rate
//   attention        attention_flops / attention rate (the backward's rate in a backward task)
//   streaming        bytes / memory bandwidth
//   launch           kernels x the per-kernel cost
//
// (the fields of rt::CostHint; a compute task's `messages` count the kernels it stands for, one
// per product, attention kernel or streaming pass, summed as its parts are). For one [m, k] x [k,
// n] product the first line is 2mnk (1 + d0/m + d0/n + d0/k) / R: the product runs at R when every
// dimension is large and slows as any dimension nears the overhead dimension d0, the rows a kernel
// pays for whether it fills them or not (tiles, waves, the edges of the blocking). At m = d0 with n
// and k large it runs at half of R; a skinny product (few tokens to an expert, a small micro-batch)
// pays most. Presets state R, d0 and the attention rate with their sources (devices/accelerators/);
// `weave calibrate` fits them to this host's kernels.
#pragma once

namespace weave::devices {

struct KernelRates {
  double matmul_flops_per_second = 0;     // R: large products' sustained FLOP/s
  double matmul_overhead_dimension = 0;   // d0, in rows; 0: every product runs at R
  double attention_flops_per_second = 0;  // blockwise (flash) attention's sustained FLOP/s
  // The same in backward tasks (rt::Phase::backward or weight); 0: attention_flops_per_second.
  double attention_backward_flops_per_second = 0;
  double memory_bytes_per_second = 0;  // streaming kernels' sustained bytes/s; 0: free
  // What each kernel costs beyond its work (the gap between back-to-back kernels of a stream);
  // 0: kernels cost only their work.
  double kernel_launch_seconds = 0;

  // Throws std::invalid_argument naming the field for a rate that is not a positive finite
  // figure, or an overhead dimension or bandwidth below 0.
  void validate() const;
};

}  // namespace weave::devices
