// Ampipe under context parallelism. Rank r holds query halves a (piece r of the 2 cp pieces)
// and b (piece 2 cp - 1 - r), so its causal attention is 2 cp - 1 full (query half, key piece)
// products and 2 diagonal ones: 2 cp units of a full product. Each chunk does cp units on every
// rank, half the rank's attention; which products go to which chunk, and the backward, are
// weave's own choice (in a 16-bit run the products are the 16-bit kernel's and the merged output
// stays fp32 until its half is complete, as in RingAttention):
//   chunk 0 runs the key/value ring and, at each step, one unit against the block in hand: a
//     against the a pieces up to its own (its diagonal at step 0, with b's), b against the a
//     pieces of the ranks after r; every block it brings stays in kv_store by owner;
//   chunk 1, without communication, completes b against the a pieces of r and the ranks before
//     it and the b pieces of the ranks after it.
// Products whose keys all follow their queries are never computed. In backward both chunks add
// their key/value gradients to per-owner blocks, which one all-to-all sends home.
#include <limits>

#include "ampipe/ampipe_block.hpp"
#include "model/ring_attention.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/elementwise.hpp"
#include "weave/ops/linear.hpp"

namespace weave::graphs {

namespace {

// One product: a query half of this rank against a key half of a block.
struct Product {
  std::int64_t query_half, key_half;
};

// Chunk c's products against `owner`'s block on cp rank `me`.
std::vector<Product> chunk_products(int me, int c, int owner) {
  if (c == 1) return {{1, owner <= me ? 0 : 1}};
  std::vector<Product> products;
  if (owner <= me) products.push_back({0, 0});
  if (owner > me) products.push_back({1, 0});
  if (owner == me) products.push_back({1, 1});
  return products;
}

// A product's work in units of a full one: 1 when every key precedes every query, 1/2 on the
// diagonal, 0 when every key follows.
double product_units(const StepShape& z, int me, int owner, Product product) {
  auto piece = [&z](int rank, std::int64_t half) { return half == 0 ? rank : 2 * z.cp - 1 - rank; };
  const int query = piece(me, product.query_half), key = piece(owner, product.key_half);
  return key < query ? 1.0 : key == query ? 0.5 : 0.0;
}

double block_units(const StepShape& z, int me, int c, int owner) {
  double units = 0;
  for (const Product& product : chunk_products(me, c, owner))
    units += product_units(z, me, owner, product);
  return units;
}

// Chunk c's work on cp rank `me`: cp units on every rank.
double chunk_units(const StepShape& z, int me, int c) {
  double units = 0;
  for (int owner = 0; owner < z.cp; ++owner)
    units += block_units(z, me, c, owner);
  return units;
}

}  // namespace

Tensor kv_block(RankProgram& P, int set, int l, int owner, bool backward) {
  LayerActivations& A = P.acts(set, l);
  const std::int64_t Sc = P.shape.Sc;
  if (owner == P.at.cp) return A.attention.kv_local;
  if (!P.shape.plan.ampipe_cp_resend_kv) return A.attention.kv_store.slice(0, owner * Sc, Sc);
  // The workspaces hold the blocks of ring steps 1 .. cp - 1.
  const int cp = P.shape.cp, step = ((P.at.cp - owner) % cp + cp) % cp;
  return (backward ? P.ws().cp_ring.kv_backward : P.ws().cp_ring.kv_forward)
      .slice(0, (step - 1) * Sc, Sc);
}

TaskId resend_blocks(RankProgram& P, const BuildPosition& pos, int l, TaskId ready) {
  const RingAttention ring(P, l);
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  TaskId arrived = ready;
  for (int t = 1; t < P.shape.cp; ++t)
    arrived = ring.shift(arrived, kv_block(P, pos.set, l, ring.owner(t - 1), true),
                         kv_block(P, pos.set, l, ring.owner(t), true),
                         fmt::format("L{}.cp_ring_kv{}", l, t), tags);
  return arrived;
}

TaskId AmpipeBlock::ring_attention(const BuildPosition& pos, int c, TaskId qkv) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, me = P->at.cp, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const int cp = z.cp;
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::forward, l, c);
  const std::string at = fmt::format("L{}.c{}.", l, c);
  // A full product is 1/(2 cp) of the rank's causal attention.
  const rt::CostHint unit = cost::causal_attention(z) / (2.0 * cp);
  auto attend = [p, layer, set, me, c, mb](int owner) {
    const RingAttention ring(*p, layer);
    for (const Product& product : chunk_products(me, c, owner))
      if (product_units(p->shape, me, owner, product) > 0)
        ring.attend_piece(set, mb, product.query_half, kv_block(*p, set, layer, owner, false),
                          owner, product.key_half);
  };
  if (c == 1) {  // every block is here: chunk 0's ring brought them
    const TaskId task = P->compute(at + "attention", tags, unit * chunk_units(z, me, 1), [=] {
      for (int owner = 0; owner < cp; ++owner)
        attend(owner);
    });
    P->after(qkv, task);
    return task;
  }
  const RingAttention ring(*P, l);
  TaskId arrived = qkv, step = rt::kNoTask;
  for (int t = 0; t < cp; ++t) {
    const int owner = ring.owner(t);
    if (t > 0) {
      // Each block lands in its owner's slot of kv_store: nothing is overwritten.
      const TaskId moved =
          ring.shift(arrived, kv_block(*P, set, l, ring.owner(t - 1), false),
                     kv_block(*P, set, l, owner, false), at + fmt::format("cp_ring{}", t), tags);
      P->after(qkv, moved);
      arrived = moved;
    }
    step = P->compute(at + (t == cp - 1 ? "attention" : "attention_step"), tags,
                      unit * block_units(z, me, 0, owner), [=] {
                        if (t == 0) {  // both halves start here: chunk 1 completes b
                          LayerActivations& A = p->acts(set, layer);
                          // A 16-bit run merges the blocks' partial outputs in fp32 in the
                          // ring's workspace, each half rounded once when complete.
                          (p->half() ? p->ws().cp_ring.merged : A.attention.attn).fill(0.f);
                          A.attention.lse.fill(-std::numeric_limits<float>::infinity());
                        }
                        attend(owner);
                      });
    P->after(arrived, step);
  }
  return step;
}

TaskId ampipe_ring_attention_backward(RankProgram& P, const BuildPosition& pos, int l, int c,
                                      TaskId ready, TaskId blocks) {
  RankProgram* p = &P;
  const int layer = l, set = pos.set, me = P.at.cp, mb = pos.micro_batch;
  const StepShape& z = P.shape;
  const std::int64_t Sc = z.Sc;
  const rt::CostHint unit = cost::causal_attention_backward(z) / (2.0 * z.cp);
  const TaskId task = P.compute(
      fmt::format("L{}.c{}.attention_backward", l, c), pos.chunk_tags(rt::Phase::backward, l, c),
      unit * chunk_units(z, me, c), [p, layer, set, me, c, Sc, mb] {
        BackwardWorkspace& w = p->ws();
        // Chunk 1's backward runs first: the chunks add dq, dk and dv from here on;
        // zeroed here, not earlier, as the layer above's deferred weight half reads d_qkv
        // until this layer's combines are launched.
        if (c == 1) w.attention.d_qkv.fill(0.f);
        const RingAttention ring(*p, layer);
        for (int owner = 0; owner < p->shape.cp; ++owner)
          for (const Product& product : chunk_products(me, c, owner))
            if (product_units(p->shape, me, owner, product) > 0)
              ring.attend_piece_backward(
                  set, mb, product.query_half, kv_block(*p, set, layer, owner, true),
                  w.cp_ring.dkv_send.slice(0, owner * Sc, Sc), owner, product.key_half);
      });
  P.after(ready, task);
  P.after(blocks, task);
  return task;
}

TaskId AmpipeBlock::send_block_gradients_home(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const StepShape& z = P->shape;
  const int cp = z.cp;
  const std::int64_t Sc = z.Sc;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward, l);
  const std::string at = fmt::format("L{}.", l);
  BackwardWorkspace& w = P->ws();
  const TaskId sent = P->context.all_to_all(ready, read_of(w.cp_ring.dkv_send),
                                            all_of(w.cp_ring.dkv_recv), at + "cp_kv_grad", tags);
  const double block = static_cast<double>(Sc * P->shape.B * P->shape.Gl * 2 * P->shape.d);
  const TaskId home =
      P->compute(at + "cp_kv_grad_sum", tags, cost::streamed(z, (cp + 1) * block), [p, cp, Sc] {
        BackwardWorkspace& w = p->ws();
        const Tensor& sum = w.cp_ring.dring[cp % 2];
        sum.copy_from(w.cp_ring.dkv_recv.slice(0, 0, Sc));
        for (int source = 1; source < cp; ++source)
          ops::accumulate(w.cp_ring.dkv_recv.slice(0, source * Sc, Sc), sum);
      });
  P->after(sent, home);
  return home;
}

}  // namespace weave::graphs
