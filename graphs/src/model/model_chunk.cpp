#include "model/model_chunk.hpp"

#include <set>

#include "model/embedding.hpp"
#include "model/half_precision.hpp"
#include "model/output_loss.hpp"
#include "model/transformer_layer.hpp"
#include "step/gradient_buckets.hpp"
#include "step/step_costs.hpp"

namespace weave::graphs {

TaskId ModelChunk::forward(const BuildPosition& pos, TaskId ready) const {
  TaskId prev = ready;
  if (k == 0) prev = Embedding(*P).forward(pos, ready);
  for (int l = P->layout.first_layer(k); l < P->layout.end_layer(k); ++l)
    prev = TransformerLayer(*P, l).forward(pos, prev);
  if (k + 1 == P->layout.chunks()) return OutputLoss(*P).forward(pos, prev);
  return prev;
}

TaskId ModelChunk::backward(const BuildPosition& pos, TaskId ready, WeightHalves& halves, bool last,
                            TaskId& word_grad_done, TaskId d_send_read) const {
  RankProgram* p = P;
  const int set = pos.set;
  const rt::TaskTags tags = pos.tags(rt::Phase::backward);
  TaskId prev;
  if (k + 1 == P->layout.chunks()) {
    prev = OutputLoss(*P).backward(pos, ready, halves);
    if (last) {
      reduce_buckets(*P, "final_norm", prev);
      word_grad_done = prev;
    }
  } else {
    // The gradient of the chunk's output, from the next stage.
    const double rows = static_cast<double>(P->shape.Sl * P->shape.B * P->shape.h);
    prev = P->compute("stage_grad_in", tags, cost::streamed(P->shape, 2 * rows),
                      [p, set] { p->ws().d_x.copy_from(p->aset(set).d_recv); });
    P->after(ready, prev);
  }
  for (int l = P->layout.end_layer(k) - 1; l >= P->layout.first_layer(k); --l) {
    // Full recomputation: the backward reaching a recomputed group runs the group's forward
    // again from its kept input (its collectives included, as Megatron-LM's checkpointed
    // forward does) before the backward of its last layer.
    const RecomputeGroup group = recompute_group(P->shape.model.recompute, P->layout, l);
    if (!group.empty() && l + 1 == group.end) {
      // The group's forward rewrites the working set the layers above may share with it: their
      // deferred weight halves read it, so they run first.
      halves.flush();
      BuildPosition again = pos;
      again.recomputing = true;
      for (int j = group.begin; j < group.end; ++j)
        prev = TransformerLayer(*P, j).forward(again, prev);
    }
    halves.at_layer(l);
    prev = TransformerLayer(*P, l).backward(pos, prev, halves, last);
  }
  halves.at_layer(-1);
  halves.flush();
  if (k > 0) {
    // The gradient of the chunk's input, for the previous stage: in a bf16 run the bf16 values
    // Megatron-LM's bf16 pipeline sends (the 16-bit stream's gradient already), fp32 with
    // --fp32-residual-connection.
    const double rows = static_cast<double>(P->shape.Sl * P->shape.B * P->shape.h);
    const TaskId out =
        P->compute("stage_grad_out", tags, cost::streamed(P->shape, 2 * rows), [p, set] {
          const Tensor& d_send = p->aset(set).d_send;
          d_send.copy_from(p->ws().d_x);
          if (p->rounds_residual_stream()) round_in_place(p->precision(), d_send);
        });
    P->after(prev, out);
    P->after(d_send_read, out);
    return out;
  }
  const TaskId embedding = Embedding(*P).backward(pos, prev);
  if (last) word_grad_done = embedding;
  return embedding;
}

TaskId ModelChunk::weight_gradients(std::vector<LayerWeightHalf> halves, bool last,
                                    TaskId& word_grad_done) const {
  // ZeRO stage 2: layer by layer, the halves write into the layer's gradient slot once the layer
  // that used it before has been reduced out of it, and the layer's staged buckets, complete
  // now (the I action's gradients moved in from where they were held), are reduced under the
  // next layer's halves: one slot written, one reduced. reduce_buckets reduces the buckets not
  // staged on the `last` only, after the chunk's every half.
  const bool staged = P->shape.plan.shard_gradients;
  TaskId done = rt::kNoTask;
  std::set<int> reduced;
  for (std::size_t i = 0; i < halves.size();) {
    const int l = halves[i].layer;
    if (staged && l >= 0) wait_for_gradient_slot(*P, l, {});
    TaskId layer_done = rt::kNoTask;
    for (; i < halves.size() && halves[i].layer == l; ++i) {
      const TaskId id = halves[i].emit();
      if (id != rt::kNoTask) layer_done = id;
    }
    if (layer_done != rt::kNoTask) done = layer_done;
    if (staged && l >= 0) {
      reduced.insert(l);
      reduce_buckets(*P, fmt::format("layers.{}.mlp", l), done, last);
      reduce_buckets(*P, fmt::format("layers.{}.attention", l), done, last);
    }
  }
  // A layer without weight halves: its buckets hold the I action's gradients alone.
  if (staged)
    for (int l = P->layout.end_layer(k) - 1; l >= P->layout.first_layer(k); --l)
      if (!reduced.count(l)) {
        wait_for_gradient_slot(*P, l, {});
        reduce_buckets(*P, fmt::format("layers.{}.mlp", l), done, last);
        reduce_buckets(*P, fmt::format("layers.{}.attention", l), done, last);
      }
  if (!last) return done;
  // The chunk's last weight halves: every bucket of the chunk is complete.
  if (k + 1 == P->layout.chunks()) {
    reduce_buckets(*P, "final_norm", done);
    word_grad_done = done;
  }
  if (!staged)
    for (int l = P->layout.end_layer(k) - 1; l >= P->layout.first_layer(k); --l) {
      reduce_buckets(*P, fmt::format("layers.{}.mlp", l), done, last);
      reduce_buckets(*P, fmt::format("layers.{}.attention", l), done, last);
    }
  if (k == 0) word_grad_done = done;
  return done;
}

}  // namespace weave::graphs
