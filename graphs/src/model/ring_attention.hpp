// Context parallelism's attention: each rank holds two load-balanced chunks of the sequence
// (chunk cp_rank and 2 cp - 1 - cp_rank of 2 cp), and the key/value blocks travel round the cp
// group's ring while each rank attends its queries to the block in hand, partial results merged
// by log-sum-exp. The backward sends the blocks round again with their gradients.
#pragma once

#include "step/rank_program.hpp"

namespace weave::graphs {

class RingAttention {
 public:
  RingAttention(RankProgram& rank, int layer) : P(&rank), l(layer) {}

  // cp steps after the QKV task; at step t this rank attends its two query chunks to the block
  // of rank (me - t) while the cp stream already passes that block on. The last step also runs
  // the output projection into proj_partial. Returns it.
  TaskId forward(const BuildPosition& pos, TaskId qkv) const;
  // From d_attn (after `start`): each rank adds its queries' contribution to the travelling
  // gradient of the block in hand and passes it on, so after cp steps and one more turn every
  // block's gradient is home, in dring[cp % 2]. Returns the last turn.
  TaskId backward(const BuildPosition& pos, TaskId start) const;

  // One turn of the ring: this rank passes `from` to the next rank, receiving the previous
  // rank's into `into` (a shift is an all-to-all in which each rank sends to one neighbour).
  TaskId shift(TaskId ready, const Tensor& from, const Tensor& into, const std::string& name,
               rt::TaskTags tags) const;
  // The cp rank whose block this rank holds at ring step t.
  int owner(int t) const;
  // Attends half `half` of this rank's queries (set `set`, micro-batch `mb`) to `block` (`owner`'s
  // keys and values), folding it into the half's output and log-sum-exp.
  void attend_half(int set, int mb, std::int64_t half, const Tensor& block, int owner) const;
  // Its backward: dq added to d_qkv, the block's dk and dv added to `grads`.
  void attend_half_backward(int set, int mb, std::int64_t half, const Tensor& block,
                            const Tensor& grads, int owner) const;
  // The same against one half `key_half` of the block: the unit Ampipe's chunks divide.
  void attend_piece(int set, int mb, std::int64_t half, const Tensor& block, int owner,
                    std::int64_t key_half) const;
  void attend_piece_backward(int set, int mb, std::int64_t half, const Tensor& block,
                             const Tensor& grads, int owner, std::int64_t key_half) const;

 private:
  // The block held at ring step t: this rank's own, or the one the ring brought.
  Tensor block(int set, int t) const;
  // Folds one key block's partial attention (o_part, lse_part) into the running result of a
  // chunk of queries: L = log(e^L1 + e^L2), O = e^(L1 - L) O1 + e^(L2 - L) O2.
  void merge_partial(const Tensor& o, const Tensor& lse, const Tensor& o_part,
                     const Tensor& lse_part) const;
  RankProgram* P;
  int l;
};

}  // namespace weave::graphs
