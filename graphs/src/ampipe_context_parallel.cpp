// Ampipe under context parallelism: chunk 0's ring keeps every key/value block by owner, chunk 1
// attends to all of them at once, and the blocks' gradients go home in one all-to-all.
#include <limits>

#include "ampipe_block.hpp"
#include "ring_attention.hpp"
#include "step_costs.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/linear.hpp"

namespace weave::graphs {

Tensor kv_block(RankProgram& P, int set, int l, int owner) {
  return P.acts(set, l).kv_store.slice(0, owner * P.shape.Sc, P.shape.Sc);
}

TaskId AmpipeBlock::ring_attention(const BuildPosition& pos, int c, TaskId qkv,
                                   std::function<void()> finish) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const int cp = z.cp;
  const std::int64_t chunk = z.chunk;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward, l);
  const std::string at = fmt::format("L{}.c{}.", l, c);
  // A half of the queries against one block is 1/(2 cp) of the rank's causal attention.
  const double per_block = cost::causal_attention(z) / (2.0 * cp);
  const double projection = cost::projection(z) / 2;
  auto begin_half = [p, layer, set, c, chunk] {
    LayerActivations& A = p->acts(set, layer);
    A.attn.slice(0, c * chunk, chunk).fill(0.f);
    A.lse.slice(0, c, 1).fill(-std::numeric_limits<float>::infinity());
  };
  if (c == 1) {  // every block is here: chunk 0's ring brought them
    const TaskId task = P->compute(at + "attention", tags, cp * per_block + projection, [=] {
      begin_half();
      const RingAttention ring(*p, layer);
      for (int owner = 0; owner < cp; ++owner)
        ring.attend_half(set, 1, kv_block(*p, set, layer, owner), owner);
      finish();
    });
    P->after(qkv, task);
    return task;
  }
  const RingAttention ring(*P, l);
  TaskId arrived = qkv, step = rt::kNoTask;
  for (int t = 0; t < cp; ++t) {
    if (t > 0) {
      // Each block lands in its owner's slot of kv_store: nothing is overwritten.
      const TaskId moved =
          ring.shift(arrived, kv_block(*P, set, l, ring.owner(t - 1)),
                     kv_block(*P, set, l, ring.owner(t)), at + fmt::format("cp_ring{}", t), tags);
      P->after(qkv, moved);
      arrived = moved;
    }
    const bool last = t == cp - 1;
    step = P->compute(at + (last ? "attention" : "attention_step"), tags,
                      per_block + (last ? projection : 0.0), [=] {
                        if (t == 0) begin_half();
                        const RingAttention ring(*p, layer);
                        ring.attend_half(set, 0, kv_block(*p, set, layer, ring.owner(t)),
                                         ring.owner(t));
                        if (last) finish();
                      });
    P->after(arrived, step);
  }
  return step;
}

void ampipe_ring_attention_backward(RankProgram& P, int set, int l, int c) {
  const StepShape& z = P.shape;
  const std::int64_t chunk = z.chunk, B = z.B, Hl = z.Hl, d = z.d, Sc = z.Sc;
  LayerActivations& A = P.acts(set, l);
  BackwardWorkspace& w = P.ws();
  const LayerShard& W = P.layer(l);
  const Tensor d_proj = w.d_mlp.slice(0, c * chunk, chunk);
  const Tensor d_attn = w.d_attn.reshape({Sc, B, Hl * d}).slice(0, c * chunk, chunk);
  const Tensor attn = A.attn.slice(0, c * chunk, chunk);
  ops::linear_backward_input(d_proj, W.proj_weight->value, d_attn);
  ops::linear_backward_weight(attn.reshape({chunk, B, Hl * d}), d_proj, W.proj_weight->grad,
                              Tensor{});
  const RingAttention ring(P, l);
  for (int owner = 0; owner < z.cp; ++owner)
    ring.attend_half_backward(set, c, kv_block(P, set, l, owner),
                              w.dkv_send.slice(0, owner * Sc, Sc), owner);
}

TaskId AmpipeBlock::send_block_gradients_home(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const StepShape& z = P->shape;
  const int cp = z.cp;
  const std::int64_t Sc = z.Sc;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  BackwardWorkspace& w = P->ws();
  const TaskId sent = P->context.all_to_all(ready, read_of(w.dkv_send), all_of(w.dkv_recv),
                                            at + "cp_kv_grad", tags);
  const TaskId home = P->compute(at + "cp_kv_grad_sum", tags, 0, [p, cp, Sc] {
    BackwardWorkspace& w = p->ws();
    const Tensor& sum = w.dring[cp % 2];
    sum.copy_from(w.dkv_recv.slice(0, 0, Sc));
    for (int source = 1; source < cp; ++source)
      ops::accumulate(w.dkv_recv.slice(0, source * Sc, Sc), sum);
  });
  P->after(sent, home);
  return home;
}

}  // namespace weave::graphs
