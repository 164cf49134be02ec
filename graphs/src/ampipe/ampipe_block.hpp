// Ampipe (--ampipe-degree N) on a MoE layer: input norm and QKV run on the whole sequence; from
// the attention to the MoE combine the sequence is cut into N chunks of queries (keys and values
// whole, the causal diagonal offset by the chunk's start), ordered so that a chunk's all-to-all
// runs on the expert group's stream while another chunk computes:
//   forward:  attention side of every chunk (attention, out-projection, residual, norm, router;
//             dispatch launched), then every chunk's experts (combine launched), then every
//             chunk's combine and residual;
//   backward: the same passes over the chunks in reverse, with the mirrored all-to-alls.
// Under SP chunk c is the contiguous rows [c n, (c+1) n) of the sequence, piece c of every tp
// rank's chunk-major shard (StepShape::shard_row): each tp rank routes the piece MindSpeed's
// permutation gives it. Under context parallelism (degree 2) the chunks are a rank's two
// load-balanced halves, with the attention split between them evenly (ampipe_context_parallel).
#pragma once

#include <vector>

#include "moe/moe_mlp.hpp"
#include "step/rank_program.hpp"
#include "step/weight_halves.hpp"

namespace weave::graphs {

class AmpipeBlock {
 public:
  AmpipeBlock(RankProgram& rank, int layer) : P(&rank), l(layer) {}

  TaskId forward(const BuildPosition& pos, TaskId ready) const;
  TaskId backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves, bool last) const;

 private:
  // Forward: chunk c's attention and out-projection (without SP its residual and norm too) after
  // the QKV task; under SP its projection's reduce-scatter, residual and norm after `side`; then
  // every chunk's experts, combine and residual after the routers' dispatches.
  TaskId chunk_attention(const BuildPosition& pos, int c, TaskId qkv) const;
  TaskId chunk_residual(const BuildPosition& pos, int c, TaskId side) const;
  TaskId moe_forward(const BuildPosition& pos, const std::vector<SlotProgress>& routed,
                     TaskId first_gathered) const;
  // Backward: every chunk's combine and experts backward after `start` (the layer above's weight
  // halves flushed under them), then per chunk its router, residual, projection and attention
  // backward (`blocks`: under CP with --ampipe-cp-resend-kv, the blocks' second ring).
  std::vector<SlotProgress> moe_backward(const BuildPosition& pos, TaskId start,
                                         WeightHalves& halves) const;
  TaskId chunk_backward(const BuildPosition& pos, int c, const SlotProgress& experts,
                        TaskId blocks) const;
  // Under CP: chunk c's attention after the QKV task (chunk 0's with the key/value ring),
  // leaving its queries' output in attn. Returns the last task.
  TaskId ring_attention(const BuildPosition& pos, int c, TaskId qkv) const;
  // Every rank's gradient of block o goes to rank o in one all-to-all over the cp group; each
  // rank sums what came into dring[cp % 2], where the QKV backward takes its block's gradient.
  TaskId send_block_gradients_home(const BuildPosition& pos, TaskId ready) const;
  RankProgram* P;
  int l;
};

// Under CP: owner o's key/value block as this rank holds it for layer l of set `set`: its own
// (kv_local), or the one the ring brought, kept in the layer's store or, with
// --ampipe-cp-resend-kv, in the workspace the forward's (or the backward's) ring fills.
Tensor kv_block(RankProgram& P, int set, int l, int owner, bool backward);
// With --ampipe-cp-resend-kv: the ring again after `ready`, bringing every block into the
// backward's workspace. Returns the last step.
TaskId resend_blocks(RankProgram& P, const BuildPosition& pos, int l, TaskId ready);
// Under CP: chunk c's attention backward against the blocks, after `ready` (when d_attn holds
// the gradients of the queries it takes) and `blocks` (when they are here): dq into d_qkv, each
// block's dk and dv into dkv_send at its owner. Returns its task.
TaskId ampipe_ring_attention_backward(RankProgram& P, const BuildPosition& pos, int l, int c,
                                      TaskId ready, TaskId blocks);

}  // namespace weave::graphs
