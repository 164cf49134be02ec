// Split experts as items (one local expert, or a capacity slice of it, of one slot), each with
// its own all-to-alls and its own tensor-parallel all-gather and reduce-scatter, pipelined so
// that the collectives of one item run under another item's GEMMs: MindSpeed's
// --ampipe-tp-sp-comm-overlap (items of every Ampipe chunk) and pipe experts with tensor-
// parallel experts (items of one slot, or under Ampipe of every chunk, expert-major).
//
// Forward, item k:   gather(k+1) issued | fc1 + act(k) | combine(k-1) issued | fc2(k) | RS(k)
//   tp stream:  ... AG(k+1) ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~ RS(k) ~~~ AG(k+2) ...
//   ep stream:  ...                  combine(k-1) ~~~~~~~~
// (the activation runs in fc1's task, so the previous item's combine hides under fc2 only).
// Backward, items in reverse: the output gradients' gather of the next item issued before this
// item's input half, whose input-gradient reduce-scatter runs under its weight half.
// Without SP and Megatron-Core's router the items are the same: the tp ranks route their own
// slices of each Ampipe chunk, so the rows are gathered and reduce-scattered. With MindSpeed's
// deepspeed_moe gate every tp rank routes the whole chunk and holds the item's rows already: as
// MindSpeed (ampipe_moe_mlp_computer.py, async_fw_all_reduce_scatter_ampipe) fc2's partial sums
// are all-reduced, each item's all-reduce issued after its fc2 and running under the next
// item's fc1, after which its combine is issued; backward fc1's input-gradient partial sums are
// all-reduced before the item's dispatch backward.
//   tp stream:  ... AR(k-1) ~~~~~~~~~~~~~~~~~ AR(k) ~~~~~~~~~~~~~~~~~~~ ...
//   compute:    fc1(k) | fc2(k) | fc1(k+1) | fc2(k+1) ...
#include "model/half_precision.hpp"
#include "moe/expert_products.hpp"
#include "moe/moe_experts.hpp"
#include "moe/moe_mlp.hpp"
#include "step/step_costs.hpp"
#include "weave/ops/activation.hpp"
#include "weave/ops/linear.hpp"

namespace weave::graphs {

namespace {

struct ItemRef {
  int slot, item;
};

// The slots' items in the order their GEMMs run. A slot's items are (local expert, capacity
// slice), expert-major. With pipe experts the slots' items run expert-major as well, each local
// expert's items of every slot (Ampipe chunk) before the next expert's, as MindSpeed's PipeExpert
// runs them under Ampipe (pipe_experts.py: expert i, then multi_data index j, where
// ampipe_async_communication.py puts chunk c's slices of expert i at i * multi_data + c *
// multi_data / degree; the backward's chunks reversed, as `slots` comes here). Without them
// (the tp-sp overlap alone) chunk-major, as its ampipe_experts_forward loops chunk, then expert.
std::vector<ItemRef> items_of(RankProgram& P, int set, int l, const std::vector<int>& slots) {
  std::vector<ItemRef> out;
  if (!P.shape.pipe_experts()) {
    for (int c : slots)
      for (std::size_t i = 0; i < P.slot(set, l, c).items.size(); ++i)
        out.push_back({c, static_cast<int>(i)});
    return out;
  }
  const int slices = P.shape.item_slices();
  const auto experts = static_cast<int>(P.shape.local_experts());
  for (int e = 0; e < experts; ++e)
    for (int c : slots)
      for (int j = 0; j < slices; ++j)
        out.push_back({c, e * slices + j});
  return out;
}

std::int64_t gathered_rows(const ExpertItem& I) {
  std::int64_t rows = 0;
  for (std::int64_t r : I.tp_gathered_rows)
    rows += r;
  return rows;
}

// The item's expert, this rank's share of it: fc1 [f1 local, h] or fc2 [h, f local].
Tensor weight_of(const Parameter& p, const ExpertItem& I) {
  return p.value.slice(0, I.expert, 1).reshape({p.value.dim(1), p.value.dim(2)});
}
// Its bf16 copy, which a bf16 run's products read.
ops::Bf16Tensor weight16_of(const Parameter& p, const ExpertItem& I) {
  return p.value16.slice(0, I.expert, 1).reshape({p.value16.dim(1), p.value16.dim(2)});
}
Tensor grad_of(const Parameter& p, const ExpertItem& I) {
  return p.grad.slice(0, I.expert, 1).reshape({p.grad.dim(1), p.grad.dim(2)});
}

void activation_forward(const ModelConfig& m, const Tensor& pre, const Tensor& out) {
  if (m.activation == Activation::swiglu)
    ops::swiglu_forward(pre, out);
  else
    ops::gelu_forward(ops::GeluForm::tanh, pre, out);
}

void activation_backward(const ModelConfig& m, const Tensor& pre, const Tensor& d_out,
                         const Tensor& d_pre) {
  if (m.activation == Activation::swiglu)
    ops::swiglu_backward(pre, d_out, d_pre);
  else
    ops::gelu_backward(ops::GeluForm::tanh, pre, d_out, d_pre);
}

// Routed replicated, fc2's partial sums go to the item's result and fc1's input-gradient partial
// sums to its input gradient, each all-reduced in place; otherwise both to tp_partial, reduce-
// scattered from there.
Tensor item_output_partial(const StepShape& z, const ExpertItem& I) {
  return z.routes_replicated ? I.expert_result : I.tp_partial;
}
Tensor item_input_grad_partial(const StepShape& z, const ExpertItem& I) {
  return z.routes_replicated ? I.d_expert_in : I.tp_partial;
}
// The output gradients of every row the item ran: routed replicated the rows that came back.
Tensor item_output_grad(const StepShape& z, const ExpertItem& I) {
  return z.routes_replicated ? I.d_arrived : I.tp_d_gathered;
}

// The all-reduce sums the whole buffer: the rows past the item's zero.
void zero_tail(const Tensor& t, std::int64_t rows) {
  t.slice(0, rows, t.dim(0) - rows).fill(0.f);
}

// Balanced routing, for the cost hints: the picks one item carries on this rank.
std::int64_t expected_item_rows(const StepShape& z) {
  return z.slot_tokens() * z.model.moe_router_topk / (z.local_experts() * z.item_slices());
}

// With --pipe-experts-multi-stream each collective waits for the one before it. Under Ampipe
// the dispatches (the forward's, and the output gradients' trip back) stay out of the chain, as
// in MindSpeed: its Ampipe issues them (ampipe_async_communication.py,
// _pipe_expert_comm_before_moe_mlp_fwd and _bwd) waiting on ag_events entries still unset
// (ampipe.py, _init_fwd_comm_list), so only their own gathers wait for them; outside Ampipe
// (pipe_experts.py, fw_bw_ag_after_first_a2a_when_multi_stream) each waits for the gather before.
struct Chain {
  RankProgram* P;
  bool on;
  bool dispatches = true;
  TaskId tail = rt::kNoTask;
  TaskId link(TaskId t) {
    if (!on || t == rt::kNoTask) return t;
    P->after(tail, t);
    tail = t;
    return t;
  }
  TaskId link_dispatch(TaskId t) { return dispatches ? link(t) : t; }
};

}  // namespace

TaskId MoeMlp::gather_item(const BuildPosition& pos, int c, int i, TaskId dispatched) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set, ep = P->shape.ep;
  const std::int64_t h = P->shape.h;
  const rt::TaskTags tags = pos.chunk_tags(rt::Phase::forward, l, slot_chunk(c));
  const std::string at = slot_prefix(c) + fmt::format("i{}.", i);
  // One item's share of the slot's regrouped rows.
  const double share = cost::regrouped_elements(P->shape) /
                       static_cast<double>(P->shape.local_experts() * P->shape.item_slices());
  const TaskId unpacked =
      P->compute(at + "experts_frame", tags, cost::streamed(P->shape, share), [=] {
        ExpertItem& I = p->slot(set, layer, c).items[static_cast<std::size_t>(i)];
        // Routed replicated the rows are every tp rank's already: fc1 runs them as gathered.
        const bool replicated = p->shape.routes_replicated;
        const Tensor& into = replicated ? I.tp_gathered : I.expert_in;
        std::int64_t framed = 0, rows = 0;
        for (int q = 0; q < ep; ++q) {
          const std::int64_t count = I.framed_recv_rows[q] - 1;
          const auto announced = static_cast<std::int64_t>(I.arrived.row(framed)[0]);
          if (announced != count)
            throw std::logic_error(
                fmt::format("expert items: expert-parallel rank {} announced {} rows and sent {}",
                            q, announced, count));
          I.recv_rows[q] = count;
          for (std::int64_t x = 0; x < count; ++x)
            std::copy_n(I.arrived.row(framed + 1 + x), h, into.row(rows + x));
          framed += 1 + count;
          rows += count;
        }
        I.tp_send_rows = rows;
        if (replicated) {
          std::fill(I.tp_gathered_rows.begin(), I.tp_gathered_rows.end(), 0);
          I.tp_gathered_rows[0] = rows;
        }
      });
  P->after(dispatched, unpacked);
  if (P->shape.routes_replicated) return unpacked;
  ExpertItem& I = P->slot(set, l, c).items[static_cast<std::size_t>(i)];
  return P->tensor.all_gather_v(unpacked,
                                {.send = read_of(I.expert_in),
                                 .send_rows = &I.tp_send_rows,
                                 .recv = all_of(I.tp_gathered),
                                 .recv_rows = std::span<std::int64_t>(I.tp_gathered_rows),
                                 .expected_rows = expected_item_rows(P->shape)},
                                h, at + "experts_gather", tags);
}

namespace {

// Slot c's index in `slots`.
std::size_t index_of(const std::vector<int>& slots, int c) {
  return static_cast<std::size_t>(std::find(slots.begin(), slots.end(), c) - slots.begin());
}

// Each item's dispatch where its slot's router issued it already (kNoTask where it did not).
std::vector<TaskId> issued_dispatches(const std::vector<ItemRef>& items,
                                      const std::vector<int>& slots,
                                      const std::vector<SlotProgress>& routed) {
  std::vector<TaskId> dispatches(items.size(), rt::kNoTask);
  for (std::size_t k = 0; k < items.size(); ++k) {
    const SlotProgress& r = routed[index_of(slots, items[k].slot)];
    if (!r.items.empty()) dispatches[k] = r.items[static_cast<std::size_t>(items[k].item)];
  }
  return dispatches;
}

// Item i of slot c, forward: fc1 and the activation on every tp rank's gathered rows.
void item_fc1(RankProgram& p, int set, int layer, int c, std::size_t i) {
  MoeSlot& S = p.slot(set, layer, c);
  ExpertItem& I = S.items[i];
  const MoeMlpParameters& W = p.moe_parameters(layer);
  const std::int64_t rows = gathered_rows(I);
  take_hidden_rows(S, I, rows);
  const Tensor pre = item_rows(S.hidden_pre, I, rows), hidden = item_rows(S.hidden, I, rows);
  if (p.half()) {  // bf16 products, the activation in fp32 rounded once
    linear_forward_half(p.precision(), I.tp_gathered.slice(0, 0, rows),
                        weight16_of(*W.experts.fc1, I), pre);
    activation_forward(p.shape.model, pre, hidden);
    round_in_place(p.precision(), hidden);
    return;
  }
  ops::linear_forward(I.tp_gathered.slice(0, 0, rows), weight_of(*W.experts.fc1, I), Tensor{}, pre);
  activation_forward(p.shape.model, pre, hidden);
}

// fc2's partial sums of them.
void item_fc2(RankProgram& p, int set, int layer, int c, std::size_t i) {
  const MoeSlot& S = p.slot(set, layer, c);
  const ExpertItem& I = S.items[i];
  const std::int64_t rows = gathered_rows(I);
  const Tensor partial = item_output_partial(p.shape, I);
  if (p.shape.routes_replicated) zero_tail(partial, rows);
  if (p.half()) {  // bf16 partial sums, reduced over tp as bf16 values
    linear_forward_half(p.precision(), item_rows(S.hidden, I, rows),
                        weight16_of(*p.moe_parameters(layer).experts.fc2, I),
                        partial.slice(0, 0, rows));
    return;
  }
  ops::linear_forward(item_rows(S.hidden, I, rows),
                      weight_of(*p.moe_parameters(layer).experts.fc2, I), Tensor{},
                      partial.slice(0, 0, rows));
}

// Backward, the input half: fc2's and the activation's backward, fc1's input-gradient partial
// sums.
void item_input_gradient(RankProgram& p, int set, int layer, int c, std::size_t i) {
  const MoeSlot& S = p.slot(set, layer, c);
  const ExpertItem& I = S.items[i];
  const MoeMlpParameters& W = p.moe_parameters(layer);
  const std::int64_t rows = gathered_rows(I);
  const Tensor pre = item_rows(S.hidden_pre, I, rows),
               d_hidden = item_rows(S.item_d_hidden, I, rows),
               d_pre = item_rows(S.item_d_pre, I, rows);
  if (!p.shape.routes_replicated && I.tp_d_gathered_rows != I.tp_gathered_rows)
    throw std::logic_error(
        "expert items: the output gradients gathered over tp do not match the forward's rows");
  const Tensor dy = item_output_grad(p.shape, I).slice(0, 0, rows);
  const Tensor partial = item_input_grad_partial(p.shape, I);
  if (p.shape.routes_replicated) zero_tail(partial, rows);
  if (p.half()) {  // the output gradient in bf16; d_pre and the partial sums bf16 values
    round_in_place(p.precision(), dy);
    linear_backward_input_half(p.precision(), dy, weight16_of(*W.experts.fc2, I), d_hidden);
    activation_backward(p.shape.model, pre, d_hidden, d_pre);
    round_in_place(p.precision(), d_pre);
    linear_backward_input_half(p.precision(), d_pre, weight16_of(*W.experts.fc1, I),
                               partial.slice(0, 0, rows));
    return;
  }
  ops::linear_backward_input(dy, weight_of(*W.experts.fc2, I), d_hidden);
  activation_backward(p.shape.model, pre, d_hidden, d_pre);
  ops::linear_backward_input(d_pre, weight_of(*W.experts.fc1, I), partial.slice(0, 0, rows));
}

// The weight half: fc2's and fc1's weight gradients (in a bf16 run every operand holds bf16
// values: the fp32 kernels give gemm_bf16's products and fp32 sums).
void item_weight_gradient(RankProgram& p, int set, int layer, int c, std::size_t i) {
  const MoeSlot& S = p.slot(set, layer, c);
  const ExpertItem& I = S.items[i];
  const MoeMlpParameters& W = p.moe_parameters(layer);
  const std::int64_t rows = gathered_rows(I);
  ops::linear_backward_weight(item_rows(S.hidden, I, rows),
                              item_output_grad(p.shape, I).slice(0, 0, rows),
                              grad_of(*W.experts.fc2, I), Tensor{});
  ops::linear_backward_weight(I.tp_gathered.slice(0, 0, rows), item_rows(S.item_d_pre, I, rows),
                              grad_of(*W.experts.fc1, I), Tensor{});
}

}  // namespace

std::vector<SlotProgress> MoeMlp::split_item_pipeline(const BuildPosition& pos,
                                                      const std::vector<int>& slots,
                                                      const std::vector<SlotProgress>& routed,
                                                      TaskId first_gathered) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const std::int64_t h = z.h;
  const auto tags = [&](int c) { return pos.chunk_tags(rt::Phase::forward, l, slot_chunk(c)); };
  const std::vector<ItemRef> items = items_of(*P, set, l, slots);
  auto slot_index = [&](int c) { return index_of(slots, c); };
  // Each item's dispatch: issued after the router, or here, where the chain reaches it.
  std::vector<TaskId> dispatches = issued_dispatches(items, slots, routed);
  auto dispatched = [&](std::size_t k) {
    if (dispatches[k] == rt::kNoTask)
      dispatches[k] = item_exchange(
          pos, items[k].slot, items[k].item, routed[slot_index(items[k].slot)].task,
          &ExpertItem::send, &ExpertItem::arrived, true, true, "dispatch", rt::Phase::forward);
    return dispatches[k];
  };
  const rt::CostHint per_item =
      cost::expert_item(z, static_cast<double>(z.slot_tokens()), z.item_slices());
  const double f1 = static_cast<double>(z.expert_f1()), f = static_cast<double>(z.fe);
  const std::int64_t expected = expected_item_rows(z);
  Chain chain{P, z.plan.pipe_experts_multi_stream, z.plan.ampipe_degree <= 1};
  // Under the chain every dispatch waits for the gather before it, so gathers are issued in
  // order ahead of every item's GEMMs; otherwise one item ahead.
  std::vector<TaskId> gathered(items.size(), rt::kNoTask);
  auto gather = [&](std::size_t k) {
    if (gathered[k] != rt::kNoTask) return;
    chain.link_dispatch(dispatched(k));
    gathered[k] = chain.link(gather_item(pos, items[k].slot, items[k].item, dispatched(k)));
  };
  if (!items.empty()) gathered[0] = first_gathered;
  if (chain.on)
    for (std::size_t k = 0; k < items.size(); ++k)
      gather(k);
  std::vector<SlotProgress> out(slots.size());
  for (std::size_t s = 0; s < slots.size(); ++s)
    out[s].task = routed[s].task;
  std::vector<TaskId> reduced(items.size(), rt::kNoTask);
  auto combine = [&](std::size_t k) {
    const ItemRef& ref = items[k];
    const TaskId sent =
        item_exchange(pos, ref.slot, ref.item, reduced[k], &ExpertItem::expert_result,
                      &ExpertItem::back, false, false, "combine", rt::Phase::forward);
    out[slot_index(ref.slot)].items.push_back(sent);
  };
  for (std::size_t k = 0; k < items.size(); ++k) {
    const ItemRef ref = items[k];
    const int c = ref.slot;
    const auto i = static_cast<std::size_t>(ref.item);
    const std::string at = slot_prefix(c) + fmt::format("i{}.", i);
    gather(k);
    if (k + 1 < items.size()) gather(k + 1);
    const TaskId first = P->compute(at + "fc1", tags(c), per_item * f1 / (f1 + f),
                                    [=] { item_fc1(*p, set, layer, c, i); });
    P->after(gathered[k], first);
    if (k > 0) combine(k - 1);
    const TaskId second = P->compute(at + "fc2", tags(c), per_item * f / (f1 + f),
                                     [=] { item_fc2(*p, set, layer, c, i); });
    ExpertItem& I = P->slot(set, l, c).items[i];
    reduced[k] = z.routes_replicated
                     ? P->tensor.all_reduce(second, all_of(I.expert_result), devices::ReduceOp::sum,
                                            at + "experts_reduce", tags(c))
                     : P->tensor.reduce_scatter_v(second,
                                                  {.send = read_of(I.tp_partial),
                                                   .rows = &I.tp_gathered_rows,
                                                   .recv = all_of(I.expert_result),
                                                   .expected_rows = expected},
                                                  h, at + "experts_scatter", tags(c));
    chain.link(reduced[k]);
  }
  if (!items.empty()) combine(items.size() - 1);
  if (chain.on)  // each combine after the reduce-scatter it carries, and before the next one
    for (std::size_t k = 0; k + 1 < items.size(); ++k) {
      const ItemRef& ref = items[k];
      const TaskId sent = out[slot_index(ref.slot)].items[static_cast<std::size_t>(ref.item)];
      P->after(sent, reduced[k + 1]);
    }
  return out;
}

std::vector<SlotProgress> MoeMlp::split_item_pipeline_backward(
    const BuildPosition& pos, const std::vector<int>& slots,
    const std::vector<SlotProgress>& arrived, WeightHalves& halves) const {
  RankProgram* p = P;
  const int layer = l, set = pos.set;
  const StepShape& z = P->shape;
  const std::int64_t h = z.h;
  const auto tags = [&](int c) { return pos.chunk_tags(rt::Phase::backward, l, slot_chunk(c)); };
  std::vector<ItemRef> items = items_of(*P, set, l, slots);
  auto slot_index = [&](int c) { return index_of(slots, c); };
  const rt::CostHint per_item =
      cost::expert_item(z, static_cast<double>(z.slot_tokens()), z.item_slices());
  const std::int64_t expected = expected_item_rows(z);
  const bool keep = halves.zero_bubble();
  Chain chain{P, z.plan.pipe_experts_multi_stream, z.plan.ampipe_degree <= 1};
  std::vector<TaskId> gathered(items.size(), rt::kNoTask);
  auto gather = [&](std::size_t k) {
    if (gathered[k] != rt::kNoTask) return;
    const ItemRef& ref = items[k];
    ExpertItem& I = P->slot(set, l, ref.slot).items[static_cast<std::size_t>(ref.item)];
    const SlotProgress& from = arrived[slot_index(ref.slot)];
    // The output gradients' trip back: issued after the combine's backward, or here, where
    // the chain reaches it.
    const TaskId ready = from.items.empty()
                             ? item_exchange(pos, ref.slot, ref.item, from.task,
                                             &ExpertItem::d_back, &ExpertItem::d_arrived, true,
                                             false, "combine_backward", rt::Phase::backward)
                             : from.items[static_cast<std::size_t>(ref.item)];
    chain.link_dispatch(ready);
    if (z.routes_replicated) {  // the item's output gradients are every tp rank's already
      gathered[k] = ready;
      return;
    }
    gathered[k] = chain.link(P->tensor.all_gather_v(
        ready,
        {.send = read_of(I.d_arrived),
         .send_rows = &I.tp_send_rows,
         .recv = all_of(I.tp_d_gathered),
         .recv_rows = std::span<std::int64_t>(I.tp_d_gathered_rows),
         .expected_rows = expected},
        h, slot_prefix(ref.slot) + fmt::format("i{}.experts_grad_gather", ref.item),
        tags(ref.slot)));
  };
  if (chain.on)
    for (std::size_t k = 0; k < items.size(); ++k)
      gather(k);
  std::vector<SlotProgress> out(slots.size());
  for (std::size_t s = 0; s < slots.size(); ++s)
    out[s].task = arrived[s].task;
  for (std::size_t k = 0; k < items.size(); ++k) {
    const ItemRef ref = items[k];
    const int c = ref.slot;
    const auto i = static_cast<std::size_t>(ref.item);
    const std::string at = slot_prefix(c) + fmt::format("i{}.", i);
    gather(k);
    if (k + 1 < items.size()) gather(k + 1);
    // The input half: fc2's and the activation's backward, fc1's input-gradient partial sums.
    const TaskId input = P->compute(at + "experts_backward", tags(c), per_item,
                                    [=] { item_input_gradient(*p, set, layer, c, i); });
    P->after(gathered[k], input);
    ExpertItem& I = P->slot(set, l, c).items[i];
    const TaskId reduced =
        z.routes_replicated
            ? P->tensor.all_reduce(input, all_of(I.d_expert_in), devices::ReduceOp::sum,
                                   at + "experts_grad_reduce", tags(c))
            : chain.link(P->tensor.reduce_scatter_v(input,
                                                    {.send = read_of(I.tp_partial),
                                                     .rows = &I.tp_gathered_rows,
                                                     .recv = all_of(I.d_expert_in),
                                                     .expected_rows = expected},
                                                    h, at + "experts_grad_scatter", tags(c)));
    // The weight half runs while the input gradient is reduce-scattered (or waits for W).
    halves.place(halves.immediate(), [=, chunk = slot_chunk(c)] {
      return p->compute(
          at + "experts_weight_grad",
          pos.chunk_tags(keep ? rt::Phase::weight : rt::Phase::backward, layer, chunk), per_item,
          [=] { item_weight_gradient(*p, set, layer, c, i); });
    });
    out[slot_index(c)].items.push_back(chain.link(item_exchange(
        pos, c, static_cast<int>(i), reduced, &ExpertItem::d_expert_in, &ExpertItem::d_home, false,
        false, "dispatch_backward", rt::Phase::backward)));
  }
  return out;
}

}  // namespace weave::graphs
