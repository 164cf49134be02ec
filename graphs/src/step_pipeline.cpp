// Pipeline parallelism: the schedule's actions over the stages, the transfers between them and
// the tied word embedding's gradient.
#include "training_step_impl.hpp"

#include "weave/graphs/pipeline_lowering.hpp"

namespace weave::graphs {

std::vector<TaskId> TrainingStep::Impl::stage_transfer(int from_pp, int to_pp,
                                                       const std::vector<TaskId>& produced,
                                                       const std::vector<std::vector<TaskId>>& free,
                                                       const std::function<Tensor(int)>& from,
                                                       const std::function<Tensor(int)>& into,
                                                       const std::string& name, rt::TaskTags tags) {
  std::vector<TaskId> arrived(ranks.size(), rt::kNoTask);
  for (int r = 0; r < mesh.size(); ++r) {
    const MeshCoordinates at = mesh.coordinates(r);
    if (at.pp != to_pp) continue;
    const int sender = mesh.rank_of(at.tp, at.cp, at.dp, from_pp);
    TaskId task;
    if (sender == r) {  // consecutive chunks on one rank: a copy on its compute stream
      task = b.add({.device = static_cast<rt::DeviceId>(r),
                    .stream = compute_stream,
                    .kind = rt::TaskKind::compute,
                    .name = name,
                    .tags = tags},
                   [from, into, r](rt::TaskContext&) { into(r).copy_from(from(r)); });
      if (produced[r] != rt::kNoTask) b.precede(produced[r], task);
    } else {
      // One stream per direction and sending stage, on both ends: the transfers between two
      // stages queue in order, as on one link, and a receive never waits behind a send to
      // another stage or a transfer the other way.
      const std::string stream = fmt::format(
          "pipeline_{}{}", tags.phase == rt::Phase::forward ? "activations" : "gradients", from_pp);
      const Tensor source = from(sender), target = into(r);
      const auto [send, receive] = comm.send_recv(
          b, static_cast<rt::DeviceId>(sender),
          {source.data(), static_cast<std::size_t>(source.numel())}, static_cast<rt::DeviceId>(r),
          all_of(target), {.name = name, .tags = tags, .stream = stream});
      if (produced[sender] != rt::kNoTask) b.precede(produced[sender], send);
      task = receive;
    }
    for (TaskId before : free[r])
      b.precede(before, task);
    arrived[r] = task;
  }
  return arrived;
}

void TrainingStep::Impl::build_pipeline() {
  const PipelineSchedule& schedule = layout.schedule;
  const int K = layout.chunks();
  word_grad_done.assign(ranks.size(), rt::kNoTask);
  // The last full backward or weight-gradient half of each chunk: its gradient buckets are
  // complete after it.
  std::vector<std::pair<int, int>> last_backward(static_cast<std::size_t>(K), {-1, -1});
  for (int pp = 0; pp < schedule.ranks; ++pp) {
    const auto& list = schedule.actions[static_cast<std::size_t>(pp)];
    for (int i = 0; i < static_cast<int>(list.size()); ++i)
      if (list[i].type == ActionType::Backward || list[i].type == ActionType::BackwardWeight)
        last_backward[static_cast<std::size_t>(schedule.stage(pp, list[i].chunk))] = {pp, i};
  }
  // Split backwards: the weight-gradient tasks each I leaves for its W, by (chunk, micro-batch).
  std::map<std::pair<int, int>, std::vector<std::function<std::vector<TaskId>()>>> pending;
  // Per (chunk, micro-batch): the tasks after which its output is, and those after which the
  // gradient of its output has arrived.
  std::map<std::pair<int, int>, std::vector<TaskId>> forward_out, gradient_in;
  // Per rank and activation set: what must be done before a transfer may overwrite the set (the
  // backward of the micro-batch that held it before).
  std::vector<std::vector<std::vector<TaskId>>> free_after(ranks.size());
  for (std::size_t r = 0; r < ranks.size(); ++r)
    free_after[r].resize(ranks[r].sets.size());
  for (const ScheduledAction& at : emission_order(schedule)) {
    const Action& a =
        schedule.actions[static_cast<std::size_t>(at.rank)][static_cast<std::size_t>(at.index)];
    if (a.type == ActionType::Idle) continue;
    const int k = schedule.stage(at.rank, a.chunk), mb = a.micro_batch;
    stage_ = at.rank;
    chunk_ = k;
    set_ = set_index.at({at.rank, k, mb});
    if (k == K - 1) output_ = output_index.at(mb);
    const int set = set_;
    std::vector<std::vector<TaskId>> free(ranks.size());
    for (std::size_t r = 0; r < ranks.size(); ++r)
      if (in_stage(static_cast<int>(r))) free[r] = free_after[r][static_cast<std::size_t>(set)];
    switch (a.type) {
      case ActionType::Forward: {
        std::vector<TaskId> ready(ranks.size(), rt::kNoTask);
        if (k > 0) {
          const int from_set = set_index.at({layout.rank_of(k - 1), k - 1, mb});
          const int last_layer = layout.end_layer(k - 1) - 1;
          ready = stage_transfer(
              layout.rank_of(k - 1), at.rank, forward_out.at({k - 1, mb}), free,
              [this, from_set, last_layer](int r) { return acts(r, from_set, last_layer).x_out; },
              [this, set](int r) { return aset(r, set).x_in; },
              fmt::format("stage{}_to_{}.activations", k - 1, k),
              {.micro_batch = mb, .virtual_stage = k, .phase = rt::Phase::forward});
        }
        forward_out[{k, mb}] = build_forward(k, mb, ready);
        break;
      }
      case ActionType::Backward:
      case ActionType::BackwardInput: {
        std::vector<TaskId> ready(ranks.size(), rt::kNoTask);
        if (k + 1 < K) ready = gradient_in.at({k, mb});
        const bool split = a.type == ActionType::BackwardInput;
        const bool last = !split && last_backward[static_cast<std::size_t>(k)] ==
                                        std::pair<int, int>{at.rank, at.index};
        split_ = split;
        auto done = build_backward(k, mb, ready, last);
        split_ = false;
        if (split) {
          pending[{k, mb}] = std::move(weight_work);
          weight_work.clear();
        }
        for (std::size_t r = 0; r < ranks.size(); ++r)
          if (done[r] != rt::kNoTask) free_after[r][static_cast<std::size_t>(set)] = {done[r]};
        if (k > 0) {
          // The input gradient leaves at once: the previous stage's set still holds this
          // micro-batch, so nothing there must finish first, and the send is ordered before the
          // next use of this set's d_send (whose forward waits for a later receive).
          const int to_pp = layout.rank_of(k - 1);
          const int to_set = set_index.at({to_pp, k - 1, mb});
          gradient_in[{k - 1, mb}] = stage_transfer(
              at.rank, to_pp, done, std::vector<std::vector<TaskId>>(ranks.size()),
              [this, set](int r) { return aset(r, set).d_send; },
              [this, to_set](int r) { return aset(r, to_set).d_recv; },
              fmt::format("stage{}_to_{}.gradients", k, k - 1),
              {.micro_batch = mb, .virtual_stage = k - 1, .phase = rt::Phase::backward});
        }
        break;
      }
      case ActionType::BackwardWeight:
        build_weight_gradients(
            k, pending.at({k, mb}),
            last_backward[static_cast<std::size_t>(k)] == std::pair<int, int>{at.rank, at.index},
            free_after, set);
        pending.erase({k, mb});
        break;
      case ActionType::Idle:
        break;
    }
  }
  stage_ = chunk_ = -1;
  set_ = 0;
  reduce_embedding();
}

void TrainingStep::Impl::build_weight_gradients(
    int k, const std::vector<std::function<std::vector<TaskId>()>>& work, bool last,
    std::vector<std::vector<std::vector<TaskId>>>& free_after, int set) {
  std::vector<TaskId> done(ranks.size(), rt::kNoTask);
  split_ = true;  // the tasks' cost hints are the split backward's
  for (const auto& emit : work) {
    const std::vector<TaskId> ids = emit();
    for (std::size_t r = 0; r < ids.size(); ++r)
      if (ids[r] != rt::kNoTask) done[r] = ids[r];
  }
  split_ = false;
  // The set is free once its weight gradients have read it; they follow the I's tasks on the
  // compute stream, so they are what a later transfer into the set waits for.
  for (std::size_t r = 0; r < ranks.size(); ++r)
    if (done[r] != rt::kNoTask) free_after[r][static_cast<std::size_t>(set)] = {done[r]};
  if (!last) return;
  // The chunk's last weight gradients: every bucket of the chunk is complete.
  if (k + 1 == layout.chunks()) {
    reduce_buckets("final_norm", done);
    word_grad_ready(done);
  }
  for (int l = layout.end_layer(k) - 1; l >= layout.first_layer(k); --l) {
    reduce_buckets(fmt::format("layers.{}.mlp", l), done);
    reduce_buckets(fmt::format("layers.{}.attention", l), done);
  }
  if (k == 0) word_grad_ready(done);
}

void TrainingStep::Impl::reduce_embedding() {
  const int first = layout.rank_of(0), last = layout.rank_of(layout.chunks() - 1);
  std::vector<TaskId> ready = word_grad_done;
  if (first != last) {
    const rt::TaskTags tags{.phase = rt::Phase::backward};
    for (int r = 0; r < mesh.size(); ++r) {
      const MeshCoordinates at = mesh.coordinates(r);
      if (at.pp != first) continue;
      const int copy = mesh.rank_of(at.tp, at.cp, at.dp, last);
      const devices::ProcessGroup pair(
          fmt::format("embedding{}", r),
          {static_cast<rt::DeviceId>(r), static_cast<rt::DeviceId>(copy)});
      const std::vector<std::span<float>> grads{all_of(ranks[r].shard->embedding().grad),
                                                all_of(ranks[copy].shard->embedding().grad)};
      const auto ids =
          comm.all_reduce(b, pair, grads, devices::ReduceOp::sum,
                          {.name = "embedding_tie", .tags = tags, .stream = "grad_comm"});
      for (int i = 0; i < 2; ++i) {
        const int member = i == 0 ? r : copy;
        if (word_grad_done[member] != rt::kNoTask) b.precede(word_grad_done[member], ids[i]);
        if (last_grad[member] != rt::kNoTask) b.precede(last_grad[member], ids[i]);
        last_grad[member] = ready[member] = ids[i];
      }
    }
  }
  for (int pp : {first, last}) {
    stage_ = pp;
    reduce_buckets("embedding", ready);
    if (first == last) break;
  }
  stage_ = -1;
}

}  // namespace weave::graphs
