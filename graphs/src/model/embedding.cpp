#include "model/embedding.hpp"

#include "model/attention_block.hpp"
#include "model/half_precision.hpp"
#include "model/sequence_parallel.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/embedding.hpp"

namespace weave::graphs {

TaskId Embedding::forward(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t Sl = z.Sl, B = z.B, h = z.h;
  const rt::TaskTags tags = pos.tags(rt::Phase::forward);
  P->wait_for_parameters("embedding");  // --overlap-param-gather: the lookup waits for the gather
  // Each rank looks up its vocabulary shard; the group sums (or reduce-scatters) the partials.
  const TaskId lookup =
      P->compute("embedding", tags, cost::streamed(z, 2.0 * z.Sc * B * h), [p, set, mb] {
        ActivationSet& X = p->aset(set);
        p->load_tokens(mb, X.tokens, false);
        const ops::EmbeddingShard vocab{p->shard().vocab_start(),
                                        p->shape.model.padded_vocab_size(p->shape.tp)};
        // A 16-bit run looks up the table's 16-bit copy, as Megatron-LM's Float16Module does:
        // the distributed optimizer keeps the fp32 main table as the replicas' shards.
        if (p->half())
          half_embedding_forward(p->precision(), X.tokens, p->shard().embedding().value16, vocab,
                                 X.emb_partial);
        else
          ops::embedding_forward<float>(X.tokens, p->shard().embedding().value, vocab,
                                        X.emb_partial);
      });
  P->after(ready, lookup);
  ActivationSet& X = P->aset(set);
  const TaskId reduced =
      reduce_partial(*P, lookup, X.emb_partial, X.x_in, "embedding_reduce", tags);
  const bool learned = z.model.learned_positions();
  const TaskId positions = P->compute("positions", tags, cost::streamed(z, 3.0 * Sl * B * h), [=] {
    ActivationSet& X = p->aset(set);
    // RoPE rotates queries and keys in the attention instead; none adds nothing.
    if (learned)
      for (std::int64_t s = 0; s < Sl; ++s)
        for (std::int64_t bi = 0; bi < B; ++bi) {
          float* row = X.x_in.data() + (s * B + bi) * h;
          const Parameter& table = p->shard().positions();
          if (p->half()) {
            add_widened(p->precision(), table.value16.row(p->position(s)), row, h);
            continue;
          }
          const float* q = table.value.row(p->position(s));
          for (std::int64_t c = 0; c < h; ++c)
            row[c] += q[c];
        }
    p->apply_dropout(false, mb, p->shape.model.num_layers, 2, X.x_in, X.x_in);
    // A bf16 run's embedding output is a bf16 value: the bf16 copies' row and position, summed in
    // fp32 and after dropout rounded once (Megatron-LM's Float16Module adds the two in bf16, the
    // same rounding of their sum, and drops out in bf16), carried in the fp32 residual stream.
    if (p->half()) round_in_place(p->precision(), X.x_in);
  });
  P->after(reduced, positions);
  return positions;
}

TaskId Embedding::backward(const BuildPosition& pos, TaskId ready) const {
  RankProgram* p = P;
  const int set = pos.set, mb = pos.micro_batch;
  const StepShape& z = P->shape;
  const std::int64_t Sl = z.Sl, B = z.B, h = z.h;
  const bool sp = z.sp(), learned = z.model.learned_positions();
  const rt::TaskTags tags = pos.tags(rt::Phase::backward);
  const TaskId positions =
      P->compute("positions_backward", tags, cost::streamed(z, 3.0 * Sl * B * h), [=] {
        BackwardWorkspace& w = p->ws();
        p->apply_dropout(true, mb, p->shape.model.num_layers, 2, w.d_x, w.d_x);
        if (learned)
          for (std::int64_t s = 0; s < Sl; ++s)
            for (std::int64_t bi = 0; bi < B; ++bi) {
              const float* g = w.d_x.data() + (s * B + bi) * h;
              float* q = p->shard().positions().grad.row(p->position(s));
              for (std::int64_t c = 0; c < h; ++c)
                q[c] += g[c];
            }
      });
  P->after(ready, positions);
  TaskId gathered = rt::kNoTask;
  if (sp)
    gathered =
        sp_gather(*P, positions, P->ws().d_x, P->ws().d_norm_full, "embedding_grad_gather", tags);
  // The rows' gradients, then the dense weight gradient added into the main one (step_costs.hpp).
  const rt::CostHint words_cost =
      cost::streamed(z, 3.0 * z.Sc * B * h) + cost::embedding_weight_gradient(z);
  const TaskId words = P->compute("embedding_backward", tags, words_cost, [p, set, sp] {
    BackwardWorkspace& w = p->ws();
    const Tensor d = sp ? w.d_norm_full : w.d_x;
    ops::embedding_backward<float>(
        p->aset(set).tokens, d,
        {p->shard().vocab_start(), p->shape.model.padded_vocab_size(p->shape.tp)},
        p->shard().embedding().grad);
  });
  P->after(gathered, words);
  return words;
}

void Embedding::declare_parameters(ParameterDeclarer& declare, const StageContents& contents,
                                   EmbeddingParameters& E) {
  const ModelConfig& m = declare.model;
  const std::int64_t h = m.hidden_size, vocab = m.padded_vocab_size(declare.tp);
  const std::int64_t v_local = vocab / declare.tp;
  const bool tied = !m.untie_embeddings_and_output_weights;
  declare.bucket("embedding");
  const bool word_held = contents.input_embedding || (tied && contents.output_layer);
  declare.hold(word_held);
  E.word = &declare.add("embedding.word", {v_local, h}, vocab, h,
                        RowMap::range(declare.vocab_start(), v_local), 0, declare.std, 0);
  declare.hold(contents.input_embedding);
  if (m.learned_positions())
    E.positions =
        &declare.replicated(declare.add("embedding.position", {m.positions(), h}, m.positions(), h,
                                        RowMap::range(0, m.positions()), 0, declare.std, 0),
                            declare.mesh.plan().sequence_parallel);
  if (!contents.input_embedding) E.positions = nullptr;
  if (!word_held) E.word = nullptr;
}

}  // namespace weave::graphs
