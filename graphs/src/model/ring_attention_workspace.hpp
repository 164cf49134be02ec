// What context parallelism's ring of key/value blocks works in, one per device for all its layers
// (one layer's attention runs at a time), forward and backward.
#pragma once

#include <cstdint>
#include <vector>

#include "weave/ops/tensor.hpp"

namespace weave::graphs {

using ops::Tensor;

struct RingAttentionWorkspace {
  // Key/value blocks and their gradients travelling round the ring (double-buffered), and one
  // block's partial attention.
  Tensor ring[2], dring[2];   // [Sc, B, Hl, 2d]
  Tensor dkv_send, dkv_recv;  // Ampipe under CP: block gradients by owner / by source [cp Sc, ...]
  // Ampipe under CP with --ampipe-cp-resend-kv: the other cp ranks' blocks, in the order the
  // forward's ring brings them and the backward's brings them again [(cp - 1) Sc, B, Hl, 2d].
  Tensor kv_forward, kv_backward;
  Tensor o_part, dq_part;  // [chunk, B, Hl, d]
  Tensor lse_part;         // [B, Hl, chunk]
  // A bf16 run: the blocks' partial outputs merged in fp32 before the one rounding into the
  // layer's bf16 attention output [Sc, B, Hl, d].
  Tensor merged;
  std::vector<std::int64_t> ring_send, ring_recv;  // rows to each cp rank: all to the next
};

}  // namespace weave::graphs
