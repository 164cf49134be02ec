#include "pipeline/pipeline_program.hpp"

#include "model/model_chunk.hpp"
#include "step/comm_streams.hpp"
#include "step/gradient_buckets.hpp"
#include "step/step_costs.hpp"
#include "weave/graphs/pipeline_lowering.hpp"

namespace weave::graphs {

namespace {

// One direction of the traffic between two stages: activations forward, gradients back.
struct Transfer {
  int from_pp, to_pp;
  std::string name;
  rt::TaskTags tags;
};

// This rank's ends of a transfer (kNoTask where it has none).
struct TransferEnds {
  TaskId send = rt::kNoTask, receive = rt::kNoTask;
};

// This rank's end of `t`, if it has one: a send of `source` after `produced` on the sending
// stage's rank, a receive into `target` after `free` (what must be done before `target` is
// overwritten) on the receiving one, or a copy on the compute stream when one rank runs both
// chunks (both ends at once).
TransferEnds transfer(RankProgram& P, const Transfer& t, TaskId produced, const Tensor& source,
                      const std::vector<TaskId>& free, const Tensor& target) {
  const int me = P.at.pp;
  if (me != t.from_pp && me != t.to_pp) return {};
  if (t.from_pp == t.to_pp) {  // consecutive chunks on one rank
    const TaskId copy = P.compute(
        t.name, t.tags, cost::streamed(P.shape, 2.0 * static_cast<double>(source.numel())),
        [source, target] { target.copy_from(source); });
    P.after(produced, copy);
    for (TaskId before : free)
      P.after(before, copy);
    return {copy, copy};
  }
  // One stream per direction and sending stage, on both ends: the transfers between two stages
  // queue in order, as on one link, and a receive never waits behind a send to another stage or
  // a transfer the other way.
  const std::string stream = fmt::format(
      "pipeline_{}{}", t.tags.phase == rt::Phase::forward ? "activations" : "gradients", t.from_pp);
  const auto peer = [&](int pp) {
    return static_cast<rt::DeviceId>(P.mesh.rank_of(P.at.tp, P.at.cp, P.at.dp, pp));
  };
  const devices::CollectiveOptions options{
      .name = t.name,
      .tags = t.tags,
      .stream = stream,
      .stream_kind = stream_kind(CommGroup::pipeline),
      .element_bytes = static_cast<std::size_t>(P.shape.model.activation_bytes())};
  if (me == t.from_pp) {
    const TaskId send =
        P.matcher.send(static_cast<rt::DeviceId>(P.rank), peer(t.to_pp), read_of(source), options);
    P.after(produced, send);
    return {send, rt::kNoTask};
  }
  const TaskId receive = P.matcher.receive(peer(t.from_pp), static_cast<rt::DeviceId>(P.rank),
                                           all_of(target), options);
  for (TaskId before : free)
    P.after(before, receive);
  return {rt::kNoTask, receive};
}

// Sums the word embedding's gradient over the first and last stage when they are different
// ranks (tied output weights), then reduces the embedding and output buckets over the replicas.
void reduce_embedding(RankProgram& P, TaskId word_grad_done) {
  const int first = P.layout.rank_of(0), last = P.layout.rank_of(P.layout.chunks() - 1);
  const int me = P.at.pp;
  if (me != first && me != last) return;
  // An untied output layer's weight is complete with the word embedding's gradient.
  if (me == last) reduce_buckets(P, "output", word_grad_done);
  TaskId ready = word_grad_done;
  if (first != last && !P.shape.model.untie_embeddings_and_output_weights) {
    const int first_rank = P.mesh.rank_of(P.at.tp, P.at.cp, P.at.dp, first);
    const int last_rank = P.mesh.rank_of(P.at.tp, P.at.cp, P.at.dp, last);
    const devices::ProcessGroup pair(
        fmt::format("embedding{}", first_rank),
        {static_cast<rt::DeviceId>(first_rank), static_cast<rt::DeviceId>(last_rank)});
    const TaskId tied = P.matcher.all_reduce(
        pair, me == first ? 0 : 1, all_of(P.shard().embedding().grad), devices::ReduceOp::sum,
        {.name = "embedding_tie",
         .tags = {.phase = rt::Phase::backward},
         .stream = "embedding",
         .stream_kind = stream_kind(CommGroup::embedding),
         .element_bytes =
             static_cast<std::size_t>(parameter_bytes(P.shape.model.precision).gradient)});
    P.track_comm("embedding", tied);
    P.after(word_grad_done, tied);
    ready = tied;
  }
  reduce_buckets(P, "embedding", ready);
}

}  // namespace

void build_pipeline(RankProgram& P) {
  const PipelineSchedule& schedule = P.layout.schedule;
  const ActivationSetPlan& sets = P.set_plan;
  const int K = P.layout.chunks(), me = P.at.pp;
  TaskId word_grad_done = rt::kNoTask;
  // The last full backward or weight-gradient half of each chunk: its gradient buckets are
  // complete after it.
  std::vector<std::pair<int, int>> last_backward(static_cast<std::size_t>(K), {-1, -1});
  for (int pp = 0; pp < schedule.ranks; ++pp) {
    const auto& list = schedule.actions[static_cast<std::size_t>(pp)];
    for (int i = 0; i < static_cast<int>(list.size()); ++i)
      if (list[i].type == ActionType::Backward || list[i].type == ActionType::BackwardWeight)
        last_backward[static_cast<std::size_t>(schedule.stage(pp, list[i].chunk))] = {pp, i};
  }
  // This rank's state of the walk: the weight halves each I leaves for its W, by (chunk,
  // micro-batch); the tasks after which a chunk's output is, or the gradient of its output has
  // arrived; and per activation set what must be done before a transfer may overwrite it (the
  // backward of the micro-batch that held it before).
  std::map<std::pair<int, int>, std::vector<WeightHalf>> pending;
  std::map<std::pair<int, int>, TaskId> forward_out, gradient_in;
  std::vector<std::vector<TaskId>> free_after(P.state.sets.size());
  // Per activation set, the send that last read its d_send.
  std::vector<TaskId> last_send(P.state.sets.size(), rt::kNoTask);
  for (const ScheduledAction& step : emission_order(schedule)) {
    const Action& a =
        schedule.actions[static_cast<std::size_t>(step.rank)][static_cast<std::size_t>(step.index)];
    if (a.type == ActionType::Idle) continue;
    const int k = schedule.stage(step.rank, a.chunk), mb = a.micro_batch;
    const bool mine = step.rank == me;
    const BuildPosition pos{.micro_batch = mb,
                            .chunk = k,
                            .set = mine ? sets.set(me, k, mb) : 0,
                            .output = mine && k == K - 1 ? sets.output_index.at(mb) : 0,
                            .tag_chunk = K > 1};
    switch (a.type) {
      case ActionType::Forward: {
        TaskId ready = rt::kNoTask;
        if (k > 0) {
          const Transfer t{P.layout.rank_of(k - 1),
                           step.rank,
                           fmt::format("stage{}_to_{}.activations", k - 1, k),
                           {.micro_batch = mb, .virtual_stage = k, .phase = rt::Phase::forward}};
          const bool sends = me == t.from_pp;
          const int from_set = sends ? sets.set(me, k - 1, mb) : 0;
          const int last_layer = P.layout.end_layer(k - 1) - 1;
          ready =
              transfer(P, t, sends ? forward_out.at({k - 1, mb}) : rt::kNoTask,
                       sends ? P.acts(from_set, last_layer).x_out : Tensor{},
                       mine ? free_after[static_cast<std::size_t>(pos.set)] : std::vector<TaskId>{},
                       mine ? P.aset(pos.set).x_in : Tensor{})
                  .receive;
        }
        if (mine) forward_out[{k, mb}] = ModelChunk(P, k).forward(pos, ready);
        break;
      }
      case ActionType::Backward:
      case ActionType::BackwardInput: {
        TaskId done = rt::kNoTask;
        if (mine) {
          const TaskId ready = k + 1 < K ? gradient_in.at({k, mb}) : rt::kNoTask;
          const bool split = a.type == ActionType::BackwardInput;
          const bool last = !split && last_backward[static_cast<std::size_t>(k)] ==
                                          std::pair<int, int>{step.rank, step.index};
          WeightHalves halves(split);
          done = ModelChunk(P, k).backward(pos, ready, halves, last, word_grad_done,
                                           last_send[static_cast<std::size_t>(pos.set)]);
          if (split) pending[{k, mb}] = halves.take_for_w();
          if (done != rt::kNoTask) free_after[static_cast<std::size_t>(pos.set)] = {done};
        }
        if (k > 0) {
          // The input gradient leaves at once: the previous stage's set still holds this
          // micro-batch, so nothing there must finish first. The set's next backward rewrites
          // d_send only after this send has read it.
          const Transfer t{
              step.rank,
              P.layout.rank_of(k - 1),
              fmt::format("stage{}_to_{}.gradients", k, k - 1),
              {.micro_batch = mb, .virtual_stage = k - 1, .phase = rt::Phase::backward}};
          const bool receives = me == t.to_pp;
          const TransferEnds ends =
              transfer(P, t, done, mine ? P.aset(pos.set).d_send : Tensor{}, {},
                       receives ? P.aset(sets.set(me, k - 1, mb)).d_recv : Tensor{});
          if (receives) gradient_in[{k - 1, mb}] = ends.receive;
          if (mine && ends.send != ends.receive)
            last_send[static_cast<std::size_t>(pos.set)] = ends.send;
        }
        break;
      }
      case ActionType::BackwardWeight:
        if (mine) {
          const bool last = last_backward[static_cast<std::size_t>(k)] ==
                            std::pair<int, int>{step.rank, step.index};
          const TaskId done = ModelChunk(P, k).weight_gradients(std::move(pending.at({k, mb})),
                                                                last, word_grad_done);
          pending.erase({k, mb});
          // The set is free once its weight gradients have read it; they follow the I's tasks
          // on the compute stream, so they are what a later transfer into the set waits for.
          if (done != rt::kNoTask) free_after[static_cast<std::size_t>(pos.set)].push_back(done);
        }
        break;
      case ActionType::Idle:
        break;
    }
  }
  reduce_embedding(P, word_grad_done);
}

}  // namespace weave::graphs
