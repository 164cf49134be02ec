// Experts split over the tensor-parallel group (MindSpeed's deepspeed_moe layout): every tp rank
// holds 1/tp of every local expert (fc1's columns, fc2's rows) and routes and dispatches its own
// tokens. The rows each tp rank received are all-gathered over tp before fc1 (framed with their
// per-expert counts, as they differ per rank when dropless) and fc2's partial sums are
// reduce-scattered back to the rank that received them; the backward gathers the output
// gradients and reduce-scatters fc1's input-gradient partial sums the same way.
// Routed replicated (MindSpeed's deepspeed_moe gate under tp without SP) every tp rank holds the
// same rows: each runs them on its share of the experts and fc2's partial sums are all-reduced
// over tp (the experts' RowParallelLinear), as fc1's input-gradient partial sums are backward
// (their ColumnParallelLinear).
#include "moe/expert_products.hpp"
#include "moe/moe_experts.hpp"
#include "moe/moe_mlp.hpp"
#include "moe/moe_token_dispatcher.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/experts.hpp"

namespace weave::graphs {

namespace {

// Block j of the gathered rows: framed rows [at, at + H + rows) of tp_gathered, and its unframed
// rows [row, row + rows) of the partial sums and hidden activations.
struct Block {
  std::int64_t framed_at = 0, row = 0, rows = 0;
};

std::vector<Block> blocks_of(const StepShape& z, const MoeSlot& A) {
  std::vector<Block> out;
  std::int64_t framed = 0, row = 0;
  for (int j = 0; j < z.tp; ++j) {
    const std::int64_t rows = A.tp_rows[static_cast<std::size_t>(j)];
    out.push_back({framed, row, rows});
    framed += z.header_rows() + rows;
    row += rows;
  }
  return out;
}

// This rank's received rows of slot c, grouped by local expert, behind a header of their counts.
void frame_received_rows(RankProgram& p, int set, int layer, int c) {
  const StepShape& z = p.shape;
  const std::int64_t h = z.h, H = z.header_rows(), L = z.local_experts();
  MoeSlot& A = p.slot(set, layer, c);
  std::vector<std::int64_t> begin;
  std::int64_t rows;
  if (z.ep > 1) {
    regroup_by_expert(z, A);
    rows = static_cast<std::int64_t>(A.source_row.size());
    for (std::int64_t i = 0; i < rows; ++i)
      std::copy_n(A.arrived.row(A.arrived_row[i]), h, A.tp_send.row(H + i));
    begin = A.local_begin;
  } else {
    rows = A.dispatch.rows();
    A.tp_send.slice(0, H, rows).copy_from(A.grouped.slice(0, 0, rows));
    begin.assign(A.dispatch.expert_begin.begin(), A.dispatch.expert_begin.end());
  }
  A.tp_send.slice(0, 0, H).fill(0.f);
  float* header = A.tp_send.row(0);
  for (std::int64_t e = 0; e < L; ++e)
    header[e] = static_cast<float>(begin[e + 1] - begin[e]);
  A.tp_send_rows = H + rows;
}

// fc1 and fc2 on every tp rank's gathered block of slot c, their partial sums into tp_partial.
void run_gathered_experts(RankProgram& p, int set, int layer, int c) {
  const StepShape& z = p.shape;
  const std::int64_t H = z.header_rows(), L = z.local_experts();
  MoeSlot& A = p.slot(set, layer, c);
  const MoeMlpParameters& W = p.moe_parameters(layer);
  const ops::ExpertActivation act = expert_activation(z.model);
  std::int64_t framed_at = 0, row = 0;
  for (int j = 0; j < z.tp; ++j) {
    const std::int64_t rows = A.tp_gathered_rows[static_cast<std::size_t>(j)] - H;
    std::vector<std::int64_t>& begin = A.tp_begin[static_cast<std::size_t>(j)];
    const float* header = A.tp_gathered.row(framed_at);
    begin[0] = 0;
    for (std::int64_t e = 0; e < L; ++e)
      begin[e + 1] = begin[e] + static_cast<std::int64_t>(header[e]);
    if (begin[L] != rows)
      throw std::logic_error(
          fmt::format("split experts: tensor-parallel rank {} sent {} rows and counts for {}", j,
                      rows, begin[L]));
    A.tp_rows[static_cast<std::size_t>(j)] = rows;
    graphs::experts_forward(act, A.tp_gathered.slice(0, framed_at + H, rows), begin,
                            expert_weights(W.experts), A.hidden_pre.slice(0, row, rows),
                            A.hidden.slice(0, row, rows), A.tp_partial.slice(0, row, rows));
    framed_at += H + rows;
    row += rows;
  }
}

// The reduced results of this rank's rows back in the slot's order: its expert output, or under
// EP the rows leaving for their sources.
void unframe_results(RankProgram& p, int set, int layer, int c) {
  MoeSlot& A = p.slot(set, layer, c);
  if (p.shape.ep == 1) {
    const std::int64_t rows = A.dispatch.rows();
    A.expert_out.slice(0, 0, rows).copy_from(A.tp_result.slice(0, 0, rows));
    return;
  }
  for (std::size_t i = 0; i < A.source_row.size(); ++i)
    std::copy_n(A.tp_result.row(static_cast<std::int64_t>(i)), p.shape.h,
                A.leaving.row(A.source_row[i]));
}

// The output gradient of this rank's rows of slot c, grouped by local expert as in forward.
void group_output_gradients(RankProgram& p, int set, int layer, int c) {
  MoeSlot& A = p.slot(set, layer, c);
  std::int64_t rows;
  if (p.shape.ep > 1) {
    rows = static_cast<std::int64_t>(A.source_row.size());
    for (std::int64_t i = 0; i < rows; ++i)
      std::copy_n(A.d_arrived.row(A.source_row[i]), p.shape.h, A.tp_d_rows.row(i));
  } else {
    rows = A.dispatch.rows();
    A.tp_d_rows.slice(0, 0, rows).copy_from(A.d_expert_out.slice(0, 0, rows));
  }
  A.tp_d_send_rows = rows;
}

// --recompute-modules moe_act: the task reading the hidden layer for fc2's weight gradient
// computes it again first (experts_backward's and experts_backward_weight's hidden_again).
bool activation_again(const RankProgram& p) {
  return p.shape.model.recompute.recomputes(kRecomputeMoeActivation);
}

// The first product's gradient a split backward keeps for its weight half: the slot's own under
// a zero-bubble schedule (the weight half waits for W), else the workspace's (it runs next).
Tensor kept_d_pre(RankProgram& p, MoeSlot& A) {
  return p.shape.splits_backward ? A.saved_d_pre : p.ws().experts_d_pre;
}

// The experts' backward on every tp rank's block of slot c, fc1's input-gradient partial sums
// into tp_partial; `keep`: the weight half runs apart (its gradient kept).
void run_gathered_experts_backward(RankProgram& p, int set, int layer, int c, bool keep) {
  const std::int64_t H = p.shape.header_rows();
  MoeSlot& A = p.slot(set, layer, c);
  const MoeMlpParameters& W = p.moe_parameters(layer);
  const ops::ExpertActivation act = expert_activation(p.shape.model);
  if (A.tp_d_gathered_rows != A.tp_rows)
    throw std::logic_error(
        "split experts: the output gradients gathered over tp do not match the rows the "
        "forward gathered");
  const std::vector<Block> blocks = blocks_of(p.shape, A);
  for (std::size_t j = 0; j < blocks.size(); ++j) {
    const Block& b = blocks[j];
    const Tensor x = A.tp_gathered.slice(0, b.framed_at + H, b.rows);
    const Tensor pre = A.hidden_pre.slice(0, b.row, b.rows);
    const Tensor hid = A.hidden.slice(0, b.row, b.rows);
    const Tensor dy = A.tp_d_gathered.slice(0, b.row, b.rows);
    const Tensor dx = A.tp_partial.slice(0, b.row, b.rows);
    if (keep) {
      graphs::experts_backward_input(act, x, A.tp_begin[j], expert_weights(W.experts), pre, hid, dy,
                                     dx, kept_d_pre(p, A).slice(0, b.row, b.rows));
    } else {
      graphs::experts_backward(act, x, A.tp_begin[j], expert_weights(W.experts), pre, hid, dy, dx,
                               W.experts.fc1->grad, W.experts.fc2->grad, activation_again(p));
    }
  }
}

// The weight half of run_gathered_experts_backward, from the kept gradient.
void gathered_experts_weight_grad(RankProgram& p, int set, int layer, int c) {
  const std::int64_t H = p.shape.header_rows();
  MoeSlot& A = p.slot(set, layer, c);
  const MoeMlpParameters& W = p.moe_parameters(layer);
  const std::vector<Block> blocks = blocks_of(p.shape, A);
  for (std::size_t j = 0; j < blocks.size(); ++j) {
    const Block& b = blocks[j];
    graphs::experts_backward_weight(
        expert_activation(p.shape.model), A.tp_gathered.slice(0, b.framed_at + H, b.rows),
        A.tp_begin[j], expert_weights(W.experts), A.hidden_pre.slice(0, b.row, b.rows),
        A.hidden.slice(0, b.row, b.rows), A.tp_d_gathered.slice(0, b.row, b.rows),
        kept_d_pre(p, A).slice(0, b.row, b.rows), W.experts.fc1->grad, W.experts.fc2->grad,
        activation_again(p));
  }
}

// The reduced input gradients of this rank's rows back in the slot's order.
void unframe_input_gradients(RankProgram& p, int set, int layer, int c) {
  MoeSlot& A = p.slot(set, layer, c);
  if (p.shape.ep == 1) {
    const std::int64_t rows = A.dispatch.rows();
    A.d_grouped.slice(0, 0, rows).copy_from(A.tp_d_in.slice(0, 0, rows));
    return;
  }
  for (std::size_t i = 0; i < A.source_row.size(); ++i)
    std::copy_n(A.tp_d_in.row(static_cast<std::int64_t>(i)), p.shape.h,
                A.d_leaving.row(A.source_row[i]));
}

// Replicated routing: the rows this rank's local experts run (the same on every tp rank),
// grouped by expert, with their outputs and gradients; under EP regrouped from their sources.
struct ReplicatedRows {
  Tensor x, y, dy, dx;
  std::span<const std::int64_t> begin;
  std::int64_t rows;
};

ReplicatedRows replicated_rows(const StepShape& z, MoeSlot& A) {
  if (z.ep == 1) {
    const std::int64_t rows = A.dispatch.rows();
    return {A.grouped.slice(0, 0, rows),      A.expert_out,
            A.d_expert_out.slice(0, 0, rows), A.d_grouped,
            A.dispatch.expert_begin,          rows};
  }
  const auto rows = static_cast<std::int64_t>(A.source_row.size());
  return {A.expert_in.slice(0, 0, rows),
          A.expert_result,
          A.d_expert_result.slice(0, 0, rows),
          A.d_expert_in,
          A.local_begin,
          rows};
}

// fc1 and fc2 on this rank's share of every local expert: fc2's partial sums in y's first rows,
// its other rows zero, as the all-reduce sums the whole buffer.
void run_replicated_experts(RankProgram& p, int set, int layer, int c) {
  const StepShape& z = p.shape;
  MoeSlot& A = p.slot(set, layer, c);
  if (z.ep > 1) {
    regroup_by_expert(z, A);
    for (std::size_t i = 0; i < A.source_row.size(); ++i)
      std::copy_n(A.arrived.row(A.arrived_row[i]), z.h,
                  A.expert_in.row(static_cast<std::int64_t>(i)));
  }
  const ReplicatedRows R = replicated_rows(z, A);
  graphs::experts_forward(
      expert_activation(z.model), R.x, R.begin, expert_weights(p.moe_parameters(layer).experts),
      A.hidden_pre.slice(0, 0, R.rows), A.hidden.slice(0, 0, R.rows), R.y.slice(0, 0, R.rows));
  R.y.slice(0, R.rows, R.y.dim(0) - R.rows).fill(0.f);
}

// The experts' backward on the same rows: fc1's input-gradient partial sums in dx's first rows
// (the rest zero); `keep`: the weight half waits for the W action.
void run_replicated_experts_backward(RankProgram& p, int set, int layer, int c, bool keep) {
  const StepShape& z = p.shape;
  MoeSlot& A = p.slot(set, layer, c);
  if (z.ep > 1)  // the gradient rows arrived by source: regroup them by expert
    for (std::size_t i = 0; i < A.source_row.size(); ++i)
      std::copy_n(A.d_arrived.row(A.source_row[i]), z.h,
                  A.d_expert_result.row(static_cast<std::int64_t>(i)));
  const ReplicatedRows R = replicated_rows(z, A);
  const MoeMlpParameters& W = p.moe_parameters(layer);
  const ops::ExpertActivation act = expert_activation(z.model);
  const Tensor pre = A.hidden_pre.slice(0, 0, R.rows), hid = A.hidden.slice(0, 0, R.rows);
  const Tensor dx = R.dx.slice(0, 0, R.rows);
  if (keep) {
    graphs::experts_backward_input(act, R.x, R.begin, expert_weights(W.experts), pre, hid, R.dy, dx,
                                   kept_d_pre(p, A).slice(0, 0, R.rows));
  } else {
    graphs::experts_backward(act, R.x, R.begin, expert_weights(W.experts), pre, hid, R.dy, dx,
                             W.experts.fc1->grad, W.experts.fc2->grad, activation_again(p));
  }
  R.dx.slice(0, R.rows, R.dx.dim(0) - R.rows).fill(0.f);
}

void replicated_experts_weight_grad(RankProgram& p, int set, int layer, int c) {
  MoeSlot& A = p.slot(set, layer, c);
  const MoeMlpParameters& W = p.moe_parameters(layer);
  const ReplicatedRows R = replicated_rows(p.shape, A);
  graphs::experts_backward_weight(expert_activation(p.shape.model), R.x, R.begin,
                                  expert_weights(W.experts), A.hidden_pre.slice(0, 0, R.rows),
                                  A.hidden.slice(0, 0, R.rows), R.dy,
                                  kept_d_pre(p, A).slice(0, 0, R.rows), W.experts.fc1->grad,
                                  W.experts.fc2->grad, activation_again(p));
}

// Under EP the reduced rows of the slot back in their sources' order, for the all-to-all.
void replicated_rows_leave(RankProgram& p, int set, int layer, int c, bool backward) {
  MoeSlot& A = p.slot(set, layer, c);
  const Tensor& from = backward ? A.d_expert_in : A.expert_result;
  const Tensor& to = backward ? A.d_leaving : A.leaving;
  for (std::size_t i = 0; i < A.source_row.size(); ++i)
    std::copy_n(from.row(static_cast<std::int64_t>(i)), p.shape.h, to.row(A.source_row[i]));
}

}  // namespace

SlotProgress MoeMlp::split_experts(const BuildPosition& pos, int c,
                                   const SlotProgress& routed) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const std::int64_t h = z.h, H = z.header_rows();
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::forward, l, slot_chunk(c));
  const std::string at = slot_prefix(c);
  if (z.routes_replicated) {
    const TaskId experts =
        P->compute(at + "experts", tags, cost::experts(z, static_cast<double>(z.slot_tokens())),
                   [=] { run_replicated_experts(*p, set, layer, c); });
    P->after(routed.task, experts);
    MoeSlot& S = P->slot(set, l, c);
    const TaskId reduced =
        P->tensor.all_reduce(experts, all_of(z.ep == 1 ? S.expert_out : S.expert_result),
                             devices::ReduceOp::sum, at + "experts_reduce", tags);
    if (z.ep == 1) return {reduced, {}};
    const TaskId out =
        P->compute(at + "experts_out", tags, cost::streamed(z, cost::regrouped_elements(z)),
                   [=] { replicated_rows_leave(*p, set, layer, c, false); });
    P->after(reduced, out);
    return {slot_exchange(pos, c, out, &MoeSlot::leaving, &MoeSlot::expert_out, false, "combine",
                          false, rt::Phase::forward),
            {}};
  }
  const TaskId framed =
      P->compute(at + "experts_frame", tags, cost::streamed(z, cost::regrouped_elements(z)),
                 [=] { frame_received_rows(*p, set, layer, c); });
  P->after(routed.task, framed);
  MoeSlot& S = P->slot(set, l, c);
  // Balanced routing, for the cost hints: every kept pick of the slot's tokens.
  const std::int64_t expected =
      std::min(z.slot_tokens() * z.model.moe_router_topk, z.slot_capacity());
  const TaskId gathered =
      P->tensor.all_gather_v(framed,
                             {.send = read_of(S.tp_send),
                              .send_rows = &S.tp_send_rows,
                              .recv = all_of(S.tp_gathered),
                              .recv_rows = std::span<std::int64_t>(S.tp_gathered_rows),
                              .expected_rows = H + expected},
                             h, at + "experts_gather", tags);
  const TaskId experts =
      P->compute(at + "experts", tags, cost::experts(z, static_cast<double>(z.slot_tokens())),
                 [=] { run_gathered_experts(*p, set, layer, c); });
  P->after(gathered, experts);
  const TaskId reduced = P->tensor.reduce_scatter_v(experts,
                                                    {.send = read_of(S.tp_partial),
                                                     .rows = &S.tp_rows,
                                                     .recv = all_of(S.tp_result),
                                                     .expected_rows = expected},
                                                    h, at + "experts_scatter", tags);
  const TaskId out =
      P->compute(at + "experts_out", tags, cost::streamed(z, cost::regrouped_elements(z)),
                 [=] { unframe_results(*p, set, layer, c); });
  P->after(reduced, out);
  if (z.ep == 1) return {out, {}};
  return {slot_exchange(pos, c, out, &MoeSlot::leaving, &MoeSlot::expert_out, false, "combine",
                        false, rt::Phase::forward),
          {}};
}

SlotProgress MoeMlp::split_experts_backward(const BuildPosition& pos, int c,
                                            const SlotProgress& arrived,
                                            WeightHalves& halves) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const std::int64_t h = z.h;
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::backward, l, slot_chunk(c));
  const std::string at = slot_prefix(c);
  // The weight half apart: waiting for W, or (deepspeed_moe) right after the input half, under
  // fc1's input-gradient collective.
  const bool keep = halves.zero_bubble() || z.experts_reduce_under_weight_gradient();
  const WeightPlacement weights = halves.immediate();
  const rt::CostHint flops = cost::experts(z, static_cast<double>(z.slot_tokens()));
  const rt::CostHint again = activation_again(*P)
                                 ? cost::expert_activation(z, static_cast<double>(z.slot_tokens()))
                                 : rt::CostHint{};
  // The input half's price, and the weight half's apart (each with the activation again where
  // moe_act computes it).
  const rt::CostHint input_half = keep ? flops : 2 * flops + again, weight_half = flops + again;
  auto weight_tags = [=, chunk = slot_chunk(c)] {
    return pos.chunk_tags(
        weights == WeightPlacement::zero_bubble ? rt::Phase::weight : rt::Phase::backward, layer,
        chunk);
  };
  if (z.routes_replicated) {
    const TaskId experts = P->compute(at + "experts_backward", tags, input_half, [=] {
      run_replicated_experts_backward(*p, set, layer, c, keep);
    });
    P->after(arrived.task, experts);
    MoeSlot& S = P->slot(set, l, c);
    const TaskId reduced =
        P->tensor.all_reduce(experts, all_of(z.ep == 1 ? S.d_grouped : S.d_expert_in),
                             devices::ReduceOp::sum, at + "experts_grad_reduce", tags);
    if (keep)
      halves.place(weights, [=] {
        return p->compute(at + "experts_weight_grad", weight_tags(), weight_half,
                          [=] { replicated_experts_weight_grad(*p, set, layer, c); });
      });
    if (z.ep == 1) return {reduced, {}};
    const TaskId out = P->compute(at + "experts_backward_out", tags,
                                  cost::streamed(z, cost::regrouped_elements(z)),
                                  [=] { replicated_rows_leave(*p, set, layer, c, true); });
    P->after(reduced, out);
    return {slot_exchange(pos, c, out, &MoeSlot::d_leaving, &MoeSlot::d_grouped, false,
                          "dispatch_backward", false, rt::Phase::backward),
            {}};
  }
  const TaskId grouped = P->compute(at + "experts_backward_frame", tags,
                                    cost::streamed(z, cost::regrouped_elements(z)),
                                    [=] { group_output_gradients(*p, set, layer, c); });
  P->after(arrived.task, grouped);
  MoeSlot& S = P->slot(set, l, c);
  const std::int64_t expected =
      std::min(z.slot_tokens() * z.model.moe_router_topk, z.slot_capacity());
  const TaskId gathered =
      P->tensor.all_gather_v(grouped,
                             {.send = read_of(S.tp_d_rows),
                              .send_rows = &S.tp_d_send_rows,
                              .recv = all_of(S.tp_d_gathered),
                              .recv_rows = std::span<std::int64_t>(S.tp_d_gathered_rows),
                              .expected_rows = expected},
                             h, at + "experts_grad_gather", tags);
  const TaskId experts = P->compute(at + "experts_backward", tags, input_half, [=] {
    run_gathered_experts_backward(*p, set, layer, c, keep);
  });
  P->after(gathered, experts);
  const TaskId reduced = P->tensor.reduce_scatter_v(experts,
                                                    {.send = read_of(S.tp_partial),
                                                     .rows = &S.tp_rows,
                                                     .recv = all_of(S.tp_d_in),
                                                     .expected_rows = expected},
                                                    h, at + "experts_grad_scatter", tags);
  if (keep)
    halves.place(weights, [=] {
      return p->compute(at + "experts_weight_grad", weight_tags(), weight_half,
                        [=] { gathered_experts_weight_grad(*p, set, layer, c); });
    });
  const TaskId out =
      P->compute(at + "experts_backward_out", tags, cost::streamed(z, cost::regrouped_elements(z)),
                 [=] { unframe_input_gradients(*p, set, layer, c); });
  P->after(reduced, out);
  if (z.ep == 1) return {out, {}};
  return {slot_exchange(pos, c, out, &MoeSlot::d_leaving, &MoeSlot::d_grouped, false,
                        "dispatch_backward", false, rt::Phase::backward),
          {}};
}

}  // namespace weave::graphs
