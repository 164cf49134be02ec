// Mixture-of-Experts layers: routing, expert-parallel dispatch and combine, experts, pipe-experts
// items, and their backward.
#include "training_step_impl.hpp"

namespace weave::graphs {

std::int64_t TrainingStep::Impl::expert_capacity() const {
  if (m.moe_expert_capacity_factor <= 0) return 0;
  const std::int64_t n = T / ampipe(), k = m.moe_router_topk;
  return static_cast<std::int64_t>(
      std::ceil(m.moe_expert_capacity_factor * static_cast<double>(n * k) /
                static_cast<double>(m.num_experts)));
}

std::int64_t TrainingStep::Impl::slot_capacity() const {
  const std::int64_t rows = ep() * (T / ampipe()) * m.moe_router_topk;
  return expert_capacity() > 0 ? std::min(rows, m.num_experts * expert_capacity()) : rows;
}

void TrainingStep::Impl::allocate_items(int r, MoeSlot& S) {
  const std::int64_t n = T / ampipe(), k = m.moe_router_topk, E = m.num_experts;
  const std::int64_t f1 = m.activation == Activation::swiglu ? 2 * f : f;
  // A source sends an expert at most one pick per token (and at most its capacity).
  const std::int64_t in = ep() * (expert_capacity() > 0 ? std::min(n, expert_capacity()) : n);
  const int slices = plan.pipe_experts_slices();
  for (int e = 0; e < E / ep(); ++e)
    for (int j = 0; j < slices; ++j) {
      ExpertItem& I = S.items.emplace_back();
      I.expert = e;
      I.slice = j;
      for (auto* v : {&I.send_rows, &I.recv_rows, &I.framed_send_rows, &I.framed_recv_rows})
        v->assign(static_cast<std::size_t>(ep()), 0);
      I.send = act(r, {n * k + ep(), h});
      I.arrived = act(r, {in + ep(), h});
      I.expert_in = act(r, {in, h});
      I.hidden_pre = act(r, {in, f1});
      I.hidden = act(r, {in, f});
      I.expert_result = act(r, {in, h});
      I.back = act(r, {n * k, h});
      I.d_back = act(r, {n * k, h});
      I.d_arrived = act(r, {in, h});
      I.d_expert_in = act(r, {in, h});
      I.d_home = act(r, {n * k, h});
    }
}

void TrainingStep::Impl::allocate_slot(int r, LayerActivations& A, int c) {
  MoeSlot& S = A.moe[c];
  const std::int64_t E = m.num_experts, k = m.moe_router_topk;
  const std::int64_t f1 = m.activation == Activation::swiglu ? 2 * f : f;
  const std::int64_t n = T / ampipe();
  S.tokens = n;
  S.moe_in = act(r, {n, h});
  S.router_logits = act(r, {n, E});
  S.probs = act(r, {n, E});
  S.topk_weight = act(r, {n, k});
  S.topk_index.assign(static_cast<std::size_t>(n * k), 0);
  // Under EP the dispatch sends `grouped` framed by header rows.
  S.grouped = act(r, {n * k + (ep() > 1 ? ep() * header_rows() : 0), h});
  S.expert_out = act(r, {n * k, h});
  S.stats = ampipe() == 1 ? A.stats_total : act(r, {2 * E + 2});
  // The slot's output: its rows of the layer's MLP output, or (tensor parallelism without
  // SP) this rank's tokens before the all-gather.
  S.moe_out = (t_sp > 1 || tp == 1) ? A.mlp_out.reshape({T, h}).slice(0, c * n, n) : act(r, {n, h});
  const std::int64_t capacity = slot_capacity();
  S.hidden_pre = act(r, {capacity, f1});
  S.hidden = act(r, {capacity, f});
  if (splits_backward_ && !pipe_experts()) S.saved_d_pre = act(r, {capacity, f1});
  if (ep() > 1) {
    const std::int64_t local = E / ep();
    S.counts_recv = act(r, {ep() * local});
    S.send_rows.assign(static_cast<std::size_t>(ep()), 0);
    S.recv_rows.assign(static_cast<std::size_t>(ep()), 0);
    S.framed_send_rows.assign(static_cast<std::size_t>(ep()), 0);
    S.framed_recv_rows.assign(static_cast<std::size_t>(ep()), 0);
    S.arrived = act(r, {capacity + ep() * header_rows(), h});
    S.expert_in = act(r, {capacity, h});
    S.expert_result = act(r, {capacity, h});
    S.leaving = act(r, {capacity, h});
    S.d_arrived = act(r, {capacity, h});
    S.d_expert_in = act(r, {capacity, h});
    S.d_expert_result = act(r, {capacity, h});
    S.d_leaving = act(r, {capacity, h});
  }
  if (pipe_experts()) allocate_items(r, S);
  S.d_moe = act(r, {n, h});
  S.d_grouped = act(r, {n * k, h});
  S.d_expert_out = act(r, {n * k, h});
  S.d_topk = act(r, {n, k});
  S.d_router_logits = act(r, {n, E});
  S.d_moe_in = act(r, {n, h});
}

ops::ExpertActivation TrainingStep::Impl::expert_activation() const {
  return m.activation == Activation::swiglu ? ops::ExpertActivation::swiglu
                                            : ops::ExpertActivation::gelu_tanh;
}

ops::RouterOptions TrainingStep::Impl::router_options() const {
  return {.top_k = m.moe_router_topk,
          .renormalize = m.moe_router_renormalize,
          .aux_loss_coeff = m.moe_aux_loss_coeff,
          .z_loss_coeff = m.moe_z_loss_coeff};
}

Tensor TrainingStep::Impl::moe_tokens(int r, const Tensor& sbh) const {
  if (t_sp > 1 || tp == 1) return sbh.reshape({T, h});
  return sbh.slice(0, mesh.coordinates(r).tp * (Sc / tp), Sc / tp).reshape({T, h});
}

ops::RouterStatistics TrainingStep::Impl::unpack_stats(const Tensor& stats, std::int64_t E) {
  ops::RouterStatistics s;
  const float* p = stats.data();
  s.assignments.assign(p, p + E);
  s.probability.assign(p + E, p + 2 * E);
  s.squared_lse = p[2 * E];
  s.tokens = static_cast<std::int64_t>(std::llround(p[2 * E + 1]));
  return s;
}

std::vector<TaskId> TrainingStep::Impl::ep_exchange(
    const std::vector<TaskId>& producers, std::function<Tensor(int)> send,
    std::function<std::vector<std::int64_t>*(int)> send_rows, std::function<Tensor(int)> recv,
    std::function<std::vector<std::int64_t>*(int)> recv_rows, std::int64_t expected_rows,
    const std::string& name, rt::TaskTags tags) {
  return per_group(GroupKind::expert, producers, [&](const devices::ProcessGroup& g) {
    std::vector<devices::VariableAllToAllBuffers> bufs;
    for (rt::DeviceId dv : g.devices()) {
      const int r = static_cast<int>(dv);
      const Tensor in = send(r), out = recv(r);
      bufs.push_back({{in.data(), static_cast<std::size_t>(in.numel())},
                      send_rows(r),
                      {out.data(), static_cast<std::size_t>(out.numel())},
                      std::span<std::int64_t>(*recv_rows(r)),
                      expected_rows});
    }
    return comm.all_to_all_v(b, g, bufs, h, {.name = name, .tags = tags});
  });
}

void TrainingStep::Impl::regroup_by_expert(MoeSlot& A) {
  const std::int64_t local = m.num_experts / ep(), H = header_rows();
  float* counts = A.counts_recv.data();  // [source][local expert]
  std::vector<std::int64_t> source_begin(static_cast<std::size_t>(ep()) + 1, 0);
  std::int64_t framed_begin = 0;
  for (int j = 0; j < ep(); ++j) {
    std::copy_n(A.arrived.row(framed_begin), local, counts + j * local);
    A.recv_rows[j] = A.framed_recv_rows[j] - H;
    source_begin[j + 1] = source_begin[j] + A.recv_rows[j];
    framed_begin += A.framed_recv_rows[j];
  }
  A.local_begin.assign(static_cast<std::size_t>(local) + 1, 0);
  A.source_row.clear();
  A.arrived_row.clear();
  for (std::int64_t e = 0; e < local; ++e) {
    for (int j = 0; j < ep(); ++j) {
      std::int64_t offset = source_begin[j];
      for (std::int64_t x = 0; x < e; ++x)
        offset += static_cast<std::int64_t>(counts[j * local + x]);
      const auto n = static_cast<std::int64_t>(counts[j * local + e]);
      for (std::int64_t i = 0; i < n; ++i) {
        A.source_row.push_back(offset + i);
        A.arrived_row.push_back(offset + i + (j + 1) * H);
      }
    }
    A.local_begin[e + 1] = static_cast<std::int64_t>(A.source_row.size());
  }
  if (A.local_begin.back() != source_begin.back())
    throw std::logic_error(fmt::format("expert-parallel regrouping: {} rows arrived, counts say {}",
                                       source_begin.back(), A.local_begin.back()));
}

std::vector<TaskId> TrainingStep::Impl::slot_exchange(int l, int c,
                                                      const std::vector<TaskId>& ready,
                                                      Tensor MoeSlot::*from, Tensor MoeSlot::*into,
                                                      bool outbound, const std::string& name,
                                                      rt::TaskTags tags, bool framed) {
  const int set = set_;
  auto rows = [this, set, l, c, framed](int r, bool sent) {
    MoeSlot& S = slot(r, set, l, c);
    if (framed) return sent ? &S.framed_send_rows : &S.framed_recv_rows;
    return sent ? &S.send_rows : &S.recv_rows;
  };
  // Balanced routing, for the cost hint: every kept pick of the slot's tokens, plus headers.
  const std::int64_t expected_rows = std::min(T / ampipe() * m.moe_router_topk, slot_capacity()) +
                                     (framed ? ep() * header_rows() : 0);
  return ep_exchange(
      ready, [=, this](int r) { return slot(r, set, l, c).*from; },
      [=](int r) { return rows(r, outbound); },
      [=, this](int r) { return slot(r, set, l, c).*into; },
      [=](int r) { return rows(r, !outbound); }, expected_rows, slot_prefix(l, c) + name, tags);
}

Tensor TrainingStep::Impl::slot_tokens(int r, int c, const Tensor& sbh) const {
  const std::int64_t n = T / ampipe();
  return moe_tokens(r, sbh).slice(0, c * n, n);
}

std::vector<TaskId> TrainingStep::Impl::moe_route(int l, int c, const std::vector<TaskId>& prev,
                                                  rt::TaskTags tags) {
  const int set = set_;
  const std::string at = slot_prefix(l, c);
  const std::int64_t E = m.num_experts;
  auto route = each(at + "router", tags, [=, this](int r) {
    MoeSlot& A = slot(r, set, l, c);
    A.moe_in.copy_from(slot_tokens(r, c, acts(r, set, l).ln2));
    const LayerShard& P = ranks[r].shard->layer(l);
    ops::linear_forward(A.moe_in, P.router_weight->value, Tensor{}, A.router_logits);
    const ops::RouterStatistics st = ops::router_forward(router_options(), A.router_logits, A.probs,
                                                         std::span(A.topk_index), A.topk_weight);
    float* p = A.stats.data();
    for (std::int64_t e = 0; e < E; ++e) {
      p[e] = static_cast<float>(st.assignments[e]);
      p[E + e] = static_cast<float>(st.probability[e]);
    }
    p[2 * E] = static_cast<float>(st.squared_lse);
    p[2 * E + 1] = static_cast<float>(st.tokens);
    // Capacity applies per slot (per Ampipe chunk, as MindSpeed does).
    A.dispatch = ops::plan_dispatch(A.topk_index, A.tokens, m.moe_router_topk, E,
                                    {.capacity_factor = m.moe_expert_capacity_factor});
    // Every rank routes different tokens (its SP shard, tp slice, cp chunks, dp batch).
    ranks[r].routed_picks += A.tokens * m.moe_router_topk;
    ranks[r].dropped_picks += A.dispatch.dropped;
    if (ep() == 1) {
      ops::permute_tokens(A.dispatch, A.moe_in, A.grouped.slice(0, 0, A.dispatch.rows()));
      return;
    }
    if (pipe_experts())
      frame_items(A);
    else
      frame_dispatch(A);
  });
  link(prev, route);
  if (ep() == 1) return route;
  if (pipe_experts()) {
    // Every item's dispatch is launched now; the routes are what the statistics wait for.
    auto& dispatched = item_tasks[{l, c}];
    dispatched.clear();
    for (std::size_t i = 0; i < slot(stage_rank(), set, l, c).items.size(); ++i)
      dispatched.push_back(item_exchange(l, c, static_cast<int>(i), route, &ExpertItem::send,
                                         &ExpertItem::arrived, true, true, "dispatch", tags));
    return route;
  }
  return slot_exchange(l, c, route, &MoeSlot::grouped, &MoeSlot::arrived, true, "dispatch", tags,
                       /*framed=*/true);
}

void TrainingStep::Impl::frame_items(MoeSlot& A) {
  const std::int64_t local = m.num_experts / ep();
  const std::int64_t slices = plan.pipe_experts_slices();
  const ops::DispatchPlan& D = A.dispatch;
  for (ExpertItem& I : A.items) {
    I.rows.clear();
    std::int64_t at = 0;
    for (int p = 0; p < ep(); ++p) {
      const std::int64_t e = p * local + I.expert;
      const std::int64_t begin = D.expert_begin[e], count = D.expert_begin[e + 1] - begin;
      const std::int64_t lo = begin + count * I.slice / slices,
                         hi = begin + count * (I.slice + 1) / slices;
      std::fill_n(I.send.row(at), h, 0.f);
      I.send.row(at)[0] = static_cast<float>(hi - lo);
      ++at;
      for (std::int64_t row = lo; row < hi; ++row, ++at) {
        std::copy_n(A.moe_in.row(D.row_token[row]), h, I.send.row(at));
        I.rows.push_back(row);
      }
      // In place: the collectives hold spans of these vectors from when the graph was built.
      I.send_rows[p] = hi - lo;
      I.framed_send_rows[p] = 1 + hi - lo;
    }
  }
}

std::vector<TaskId> TrainingStep::Impl::item_exchange(int l, int c, int i,
                                                      const std::vector<TaskId>& ready,
                                                      Tensor ExpertItem::*from,
                                                      Tensor ExpertItem::*into, bool outbound,
                                                      bool framed, const std::string& name,
                                                      rt::TaskTags tags) {
  const int set = set_;
  const std::string stream = !plan.pipe_experts_multi_stream ? "comm"
                             : outbound                      ? "ep_dispatch"
                                                             : "ep_combine";
  // Balanced routing, for the cost hint: an item carries 1/(local experts x slices) of the picks.
  const std::int64_t expected_rows =
      T / ampipe() * m.moe_router_topk / (m.num_experts / ep() * plan.pipe_experts_slices()) +
      (framed ? ep() : 0);
  const std::string task = slot_prefix(l, c) + fmt::format("i{}.", i) + name;
  return per_group(GroupKind::expert, ready, [&](const devices::ProcessGroup& g) {
    std::vector<devices::VariableAllToAllBuffers> bufs;
    for (rt::DeviceId dv : g.devices()) {
      ExpertItem& I = slot(static_cast<int>(dv), set, l, c).items[static_cast<std::size_t>(i)];
      const Tensor in = I.*from, out = I.*into;
      auto* sent = framed ? &I.framed_send_rows : outbound ? &I.send_rows : &I.recv_rows;
      auto* received = framed ? &I.framed_recv_rows : outbound ? &I.recv_rows : &I.send_rows;
      bufs.push_back({{in.data(), static_cast<std::size_t>(in.numel())},
                      sent,
                      {out.data(), static_cast<std::size_t>(out.numel())},
                      std::span<std::int64_t>(*received),
                      expected_rows});
    }
    return comm.all_to_all_v(b, g, bufs, h, {.name = task, .tags = tags, .stream = stream});
  });
}

void TrainingStep::Impl::frame_dispatch(MoeSlot& A) {
  const std::int64_t local = m.num_experts / ep(), H = header_rows();
  const ops::DispatchPlan& D = A.dispatch;
  std::int64_t at = 0;
  for (int j = 0; j < ep(); ++j) {
    std::fill_n(A.grouped.row(at), H * h, 0.f);
    float* header = A.grouped.row(at);
    for (std::int64_t e = 0; e < local; ++e)
      header[e] =
          static_cast<float>(D.expert_begin[j * local + e + 1] - D.expert_begin[j * local + e]);
    at += H;
    const std::int64_t first = D.expert_begin[j * local], last = D.expert_begin[(j + 1) * local];
    for (std::int64_t row = first; row < last; ++row, ++at)
      std::copy_n(A.moe_in.row(D.row_token[row]), h, A.grouped.row(at));
    // In place: the collectives hold spans of these vectors from when the graph was built.
    A.send_rows[j] = last - first;
    A.framed_send_rows[j] = H + last - first;
  }
}

std::vector<TaskId> TrainingStep::Impl::moe_experts(int l, int c, const std::vector<TaskId>& ready,
                                                    rt::TaskTags tags) {
  const int set = set_;
  if (pipe_experts()) return moe_experts_items(l, c, ready, tags);
  const std::string at = slot_prefix(l, c);
  auto experts = each(at + "experts", tags, [=, this](int r) {
    MoeSlot& A = slot(r, set, l, c);
    const LayerShard& P = ranks[r].shard->layer(l);
    if (ep() == 1) {
      const std::int64_t rows = A.dispatch.rows();
      ops::experts_forward(expert_activation(), A.grouped.slice(0, 0, rows),
                           A.dispatch.expert_begin, P.expert_fc1->value, P.expert_fc2->value,
                           A.hidden_pre.slice(0, 0, rows), A.hidden.slice(0, 0, rows),
                           A.expert_out.slice(0, 0, rows));
      return;
    }
    regroup_by_expert(A);
    const auto rows = static_cast<std::int64_t>(A.source_row.size());
    for (std::int64_t i = 0; i < rows; ++i)
      std::copy_n(A.arrived.row(A.arrived_row[i]), h, A.expert_in.row(i));
    ops::experts_forward(expert_activation(), A.expert_in.slice(0, 0, rows), A.local_begin,
                         P.expert_fc1->value, P.expert_fc2->value, A.hidden_pre.slice(0, 0, rows),
                         A.hidden.slice(0, 0, rows), A.expert_result.slice(0, 0, rows));
    for (std::int64_t i = 0; i < rows; ++i)
      std::copy_n(A.expert_result.row(i), h, A.leaving.row(A.source_row[i]));
  });
  link(ready, experts);
  if (ep() == 1) return experts;
  return slot_exchange(l, c, experts, &MoeSlot::leaving, &MoeSlot::expert_out, false, "combine",
                       tags);
}

std::vector<TaskId> TrainingStep::Impl::moe_combine(int l, int c, const std::vector<TaskId>& ready,
                                                    rt::TaskTags tags) {
  const int set = set_;
  const std::string at = slot_prefix(l, c);
  auto combine = each(at + "combine", tags, [=, this](int r) {
    MoeSlot& A = slot(r, set, l, c);
    for (const ExpertItem& I : A.items)  // the items' results back into the slot's rows
      for (std::size_t x = 0; x < I.rows.size(); ++x)
        std::copy_n(I.back.row(static_cast<std::int64_t>(x)), h, A.expert_out.row(I.rows[x]));
    ops::combine_tokens(A.dispatch, A.expert_out.slice(0, 0, A.dispatch.rows()), A.topk_weight,
                        A.moe_out);
  });
  link(ready, combine);
  if (pipe_experts()) {
    for (const auto& returned : item_tasks[{l, c}])
      link(returned, combine);
    item_tasks.erase({l, c});
  }
  return combine;
}

std::vector<TaskId> TrainingStep::Impl::moe_experts_items(int l, int c,
                                                          const std::vector<TaskId>& ready,
                                                          rt::TaskTags tags) {
  const int set = set_;
  const std::vector<std::vector<TaskId>> dispatched = std::move(item_tasks[{l, c}]);
  auto& returned = item_tasks[{l, c}];
  returned.clear();
  for (std::size_t i = 0; i < dispatched.size(); ++i) {
    auto experts = each(slot_prefix(l, c) + fmt::format("i{}.experts", i), tags, [=, this](int r) {
      ExpertItem& I = slot(r, set, l, c).items[i];
      const LayerShard& P = ranks[r].shard->layer(l);
      std::int64_t at = 0, rows = 0;
      for (int p = 0; p < ep(); ++p) {
        const std::int64_t count = I.framed_recv_rows[p] - 1;
        const auto announced = static_cast<std::int64_t>(I.arrived.row(at)[0]);
        if (announced != count)
          throw std::logic_error(
              fmt::format("pipe experts: expert-parallel rank {} announced {} rows and sent {}", p,
                          announced, count));
        I.recv_rows[p] = count;
        for (std::int64_t x = 0; x < count; ++x)
          std::copy_n(I.arrived.row(at + 1 + x), h, I.expert_in.row(rows + x));
        at += 1 + count;
        rows += count;
      }
      const std::array<std::int64_t, 2> begin{0, rows};
      ops::experts_forward(expert_activation(), I.expert_in.slice(0, 0, rows), begin,
                           P.expert_fc1->value.slice(0, I.expert, 1),
                           P.expert_fc2->value.slice(0, I.expert, 1),
                           I.hidden_pre.slice(0, 0, rows), I.hidden.slice(0, 0, rows),
                           I.expert_result.slice(0, 0, rows));
    });
    link(ready, experts);
    link(dispatched[i], experts);
    returned.push_back(item_exchange(l, c, static_cast<int>(i), experts, &ExpertItem::expert_result,
                                     &ExpertItem::back, false, false, "combine", tags));
  }
  return ready;
}

std::vector<TaskId> TrainingStep::Impl::moe_statistics(int l, int mb,
                                                       const std::vector<TaskId>& ready,
                                                       rt::TaskTags tags) {
  const int set = set_;
  const std::string at = fmt::format("L{}.", l);
  std::vector<TaskId> summed = ready;
  if (ampipe() > 1) {
    summed = each(at + "router_statistics", tags, [=, this](int r) {
      LayerActivations& A = acts(r, set, l);
      A.stats_total.fill(0.f);
      for (const MoeSlot& S : A.moe)
        ops::accumulate(S.stats, A.stats_total);
    });
    link(ready, summed);
  }
  auto reduced = all_reduce_over(
      GroupKind::tensor_context, summed,
      [this, l, set](int r) { return acts(r, set, l).stats_total; }, devices::ReduceOp::sum,
      at + "router_stats", tags);
  auto aux = each(at + "router_losses", tags, [=, this](int r) {
    const ops::RouterStatistics st = unpack_stats(acts(r, set, l).stats_total, m.num_experts);
    ranks[r].aux[mb] += ops::aux_loss(router_options(), st) + ops::z_loss(router_options(), st);
  });
  link(reduced, aux);
  link(summed, aux);
  return aux;
}

std::vector<TaskId> TrainingStep::Impl::build_moe_forward(int l, int mb,
                                                          const std::vector<TaskId>& prev,
                                                          rt::TaskTags tags) {
  const int set = set_;
  auto routed = moe_route(l, 0, prev, tags);
  auto stats = moe_statistics(l, mb, routed, tags);
  auto experts = moe_experts(l, 0, routed, tags);
  auto combine = moe_combine(l, 0, experts, tags);
  link(stats, combine);
  if (t_sp > 1 || tp == 1) return combine;
  // Without SP the layer's output is replicated: gather the ranks' slices.
  return tp_all_gather(
      combine, [=, this](int r) { return slot(r, set, l, 0).moe_out; },
      [=, this](int r) { return acts(r, set, l).mlp_out; }, fmt::format("L{}.moe_gather", l), tags);
}

std::vector<TaskId> TrainingStep::Impl::moe_combine_backward(int l, int c,
                                                             const std::vector<TaskId>& prev,
                                                             rt::TaskTags tags) {
  const int set = set_;
  const std::string at = slot_prefix(l, c);
  auto combine = each(at + "combine_backward", tags, [=, this](int r) {
    MoeSlot& A = slot(r, set, l, c);
    // This slot's tokens' output gradient.
    A.d_moe.copy_from(slot_tokens(r, c, ranks[r].ws.d_mlp));
    const std::int64_t rows = A.dispatch.rows();
    ops::combine_tokens_backward(A.dispatch, A.expert_out.slice(0, 0, rows), A.topk_weight, A.d_moe,
                                 A.d_expert_out.slice(0, 0, rows), A.d_topk);
    for (ExpertItem& I : A.items)  // each item's rows, by destination
      for (std::size_t x = 0; x < I.rows.size(); ++x)
        std::copy_n(A.d_expert_out.row(I.rows[x]), h, I.d_back.row(static_cast<std::int64_t>(x)));
  });
  link(prev, combine);
  if (ep() == 1) return combine;
  if (pipe_experts()) {
    auto& sent = item_tasks[{l, c}];
    sent.clear();
    for (std::size_t i = 0; i < slot(stage_rank(), set, l, c).items.size(); ++i)
      sent.push_back(item_exchange(l, c, static_cast<int>(i), combine, &ExpertItem::d_back,
                                   &ExpertItem::d_arrived, true, false, "combine_backward", tags));
    return combine;
  }
  return slot_exchange(l, c, combine, &MoeSlot::d_expert_out, &MoeSlot::d_arrived, true,
                       "combine_backward", tags);
}

std::vector<TaskId> TrainingStep::Impl::moe_experts_backward(int l, int c,
                                                             const std::vector<TaskId>& ready,
                                                             rt::TaskTags tags) {
  const int set = set_;
  if (pipe_experts()) return moe_experts_backward_items(l, c, ready, tags);
  const std::string at = slot_prefix(l, c);
  // The rows the local experts ran, grouped by expert, with their offsets and gradients.
  struct ExpertRows {
    Tensor x, dy, dx;
    std::span<const std::int64_t> begin;
    std::int64_t rows;
  };
  auto expert_rows = [this](MoeSlot& A) -> ExpertRows {
    if (ep() == 1) {
      const std::int64_t rows = A.dispatch.rows();
      return {A.grouped.slice(0, 0, rows), A.d_expert_out.slice(0, 0, rows),
              A.d_grouped.slice(0, 0, rows), A.dispatch.expert_begin, rows};
    }
    const auto rows = static_cast<std::int64_t>(A.source_row.size());
    return {A.expert_in.slice(0, 0, rows), A.d_expert_result.slice(0, 0, rows),
            A.d_expert_in.slice(0, 0, rows), A.local_begin, rows};
  };
  const bool split = split_;
  auto experts = each(at + "experts_backward", tags, [=, this](int r) {
    MoeSlot& A = slot(r, set, l, c);
    const LayerShard& P = ranks[r].shard->layer(l);
    if (ep() > 1)  // the gradient rows arrived by source: regroup them by expert
      for (std::size_t i = 0; i < A.source_row.size(); ++i)
        std::copy_n(A.d_arrived.row(A.source_row[i]), h,
                    A.d_expert_result.row(static_cast<std::int64_t>(i)));
    const ExpertRows E = expert_rows(A);
    const Tensor pre = A.hidden_pre.slice(0, 0, E.rows), hid = A.hidden.slice(0, 0, E.rows);
    if (split)  // the weight gradients wait for the W action (experts_weight_grad)
      ops::experts_backward_input(expert_activation(), E.x, E.begin, P.expert_fc1->value,
                                  P.expert_fc2->value, pre, hid, E.dy, E.dx,
                                  A.saved_d_pre.slice(0, 0, E.rows));
    else
      ops::experts_backward(expert_activation(), E.x, E.begin, P.expert_fc1->value,
                            P.expert_fc2->value, pre, hid, E.dy, E.dx, P.expert_fc1->grad,
                            P.expert_fc2->grad);
    if (ep() > 1)
      for (std::size_t i = 0; i < A.source_row.size(); ++i)
        std::copy_n(A.d_expert_in.row(static_cast<std::int64_t>(i)), h,
                    A.d_leaving.row(A.source_row[i]));
  });
  link(ready, experts);
  if (split)
    weight_grad(at + "experts_weight_grad", tags, [=, this](int r) {
      MoeSlot& A = slot(r, set, l, c);
      const LayerShard& P = ranks[r].shard->layer(l);
      const ExpertRows E = expert_rows(A);
      ops::experts_backward_weight(E.x, E.begin, A.hidden.slice(0, 0, E.rows), E.dy,
                                   A.saved_d_pre.slice(0, 0, E.rows), P.expert_fc1->grad,
                                   P.expert_fc2->grad);
    });
  if (ep() == 1) return experts;
  return slot_exchange(l, c, experts, &MoeSlot::d_leaving, &MoeSlot::d_grouped, false,
                       "dispatch_backward", tags);
}

std::vector<TaskId> TrainingStep::Impl::moe_experts_backward_items(int l, int c,
                                                                   const std::vector<TaskId>& ready,
                                                                   rt::TaskTags tags) {
  const int set = set_;
  const std::vector<std::vector<TaskId>> arrived = std::move(item_tasks[{l, c}]);
  auto& home = item_tasks[{l, c}];
  home.clear();
  for (std::size_t i = 0; i < arrived.size(); ++i) {
    auto experts =
        each(slot_prefix(l, c) + fmt::format("i{}.experts_backward", i), tags, [=, this](int r) {
          ExpertItem& I = slot(r, set, l, c).items[i];
          const LayerShard& P = ranks[r].shard->layer(l);
          std::int64_t rows = 0;
          for (int p = 0; p < ep(); ++p)
            rows += I.recv_rows[p];
          const std::array<std::int64_t, 2> begin{0, rows};
          ops::experts_backward(
              expert_activation(), I.expert_in.slice(0, 0, rows), begin,
              P.expert_fc1->value.slice(0, I.expert, 1), P.expert_fc2->value.slice(0, I.expert, 1),
              I.hidden_pre.slice(0, 0, rows), I.hidden.slice(0, 0, rows),
              I.d_arrived.slice(0, 0, rows), I.d_expert_in.slice(0, 0, rows),
              P.expert_fc1->grad.slice(0, I.expert, 1), P.expert_fc2->grad.slice(0, I.expert, 1));
        });
    link(ready, experts);
    link(arrived[i], experts);
    home.push_back(item_exchange(l, c, static_cast<int>(i), experts, &ExpertItem::d_expert_in,
                                 &ExpertItem::d_home, false, false, "dispatch_backward", tags));
  }
  return ready;
}

std::vector<TaskId> TrainingStep::Impl::moe_router_backward(int l, int c,
                                                            const std::vector<TaskId>& ready,
                                                            rt::TaskTags tags) {
  const int set = set_;
  const std::string at = slot_prefix(l, c);
  auto router = each(at + "router_backward", tags, [=, this](int r) {
    MoeSlot& A = slot(r, set, l, c);
    const LayerShard& P = ranks[r].shard->layer(l);
    for (const ExpertItem& I : A.items)  // each item's input gradients into the slot's rows
      for (std::size_t x = 0; x < I.rows.size(); ++x)
        std::copy_n(I.d_home.row(static_cast<std::int64_t>(x)), h, A.d_grouped.row(I.rows[x]));
    ops::permute_tokens_backward(A.dispatch, A.d_grouped.slice(0, 0, A.dispatch.rows()),
                                 A.d_moe_in);
    const ops::RouterStatistics st = unpack_stats(acts(r, set, l).stats_total, m.num_experts);
    const double scale = 1.0 / (M * plan.data_parallel);
    ops::router_backward<float>(router_options(), A.router_logits, A.probs, A.topk_index,
                                A.topk_weight, A.d_topk, st, scale, A.d_router_logits);
    ops::linear_backward_weight(A.moe_in, A.d_router_logits, P.router_weight->grad, Tensor{});
    // d_moe_in += d_logits W_router (d_moe is free again and holds the product).
    ops::linear_backward_input(A.d_router_logits, P.router_weight->value, A.d_moe);
    ops::accumulate(A.d_moe, A.d_moe_in);
  });
  link(ready, router);
  if (pipe_experts()) {
    for (const auto& home : item_tasks[{l, c}])
      link(home, router);
    item_tasks.erase({l, c});
  }
  return router;
}

std::vector<TaskId> TrainingStep::Impl::build_moe_backward(int l, int mb,
                                                           const std::vector<TaskId>& prev,
                                                           rt::TaskTags tags) {
  const int set = set_;
  (void)mb;
  auto combined = moe_combine_backward(l, 0, prev, tags);
  flush_weight_grads();  // the layer above's, while the combine's gradient is in flight
  auto back = moe_experts_backward(l, 0, combined, tags);
  auto router = moe_router_backward(l, 0, back, tags);
  auto W = [this](int r) -> BackwardWorkspace& { return ranks[r].ws; };
  auto place = each(fmt::format("L{}.moe_input_grad", l), tags, [=, this](int r) {
    if (t_sp > 1 || tp == 1) W(r).d_norm.reshape({T, h}).copy_from(slot(r, set, l, 0).d_moe_in);
  });
  link(router, place);
  if (t_sp > 1 || tp == 1) return place;
  // Replicated layout: every rank needs the whole sequence's input gradient.
  return tp_all_gather(
      router, [=, this](int r) { return slot(r, set, l, 0).d_moe_in; },
      [=](int r) { return W(r).d_norm; }, fmt::format("L{}.moe_grad_gather", l), tags);
}

}  // namespace weave::graphs
