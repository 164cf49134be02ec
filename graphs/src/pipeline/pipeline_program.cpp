#include "pipeline/pipeline_program.hpp"

#include "model/model_chunk.hpp"
#include "step/comm_streams.hpp"
#include "step/gradient_buckets.hpp"
#include "step/step_costs.hpp"
#include "weave/graphs/pipeline_transfers.hpp"

namespace weave::graphs {

namespace {

// This rank's ends of a transfer (kNoTask where it has none).
struct TransferEnds {
  TaskId send = rt::kNoTask, receive = rt::kNoTask;
};

// "stage2_to_3.activations", tagged with the micro-batch and the receiving stage.
std::string transfer_name(const StageTransfer& t) {
  return fmt::format("stage{}_to_{}.{}", t.from_stage, t.to_stage,
                     t.direction == TransferDirection::Activations ? "activations" : "gradients");
}

rt::TaskTags transfer_tags(const StageTransfer& t) {
  return {.micro_batch = t.micro_batch,
          .virtual_stage = t.to_stage,
          .phase = t.direction == TransferDirection::Activations ? rt::Phase::forward
                                                                 : rt::Phase::backward};
}

// This rank's end of `t`, if it has one: a send of `source` after `produced` on the sending
// stage's rank, a receive into `target` after `free` (what must be done before `target` is
// overwritten) on the receiving one, or a copy on the compute stream when one rank runs both
// chunks (both ends at once).
TransferEnds transfer(RankProgram& P, const StageTransfer& t, TaskId produced, const Tensor& source,
                      const std::vector<TaskId>& free, const Tensor& target) {
  const int me = P.at.pp;
  if (me != t.from_rank && me != t.to_rank) return {};
  const std::string name = transfer_name(t);  // the collective options only view it
  if (t.local()) {                            // consecutive chunks on one rank
    const TaskId copy = P.compute(
        name, transfer_tags(t), cost::streamed(P.shape, 2.0 * static_cast<double>(source.numel())),
        [source, target] { target.copy_from(source); });
    P.after(produced, copy);
    for (TaskId before : free)
      P.after(before, copy);
    return {copy, copy};
  }
  // One stream per direction and sending rank, on both ends: the transfers between two stages
  // queue in order, as on one link, and a receive never waits behind a send to another stage or
  // a transfer the other way.
  const std::string stream = fmt::format(
      "pipeline_{}{}", t.direction == TransferDirection::Activations ? "activations" : "gradients",
      t.from_rank);
  const auto peer = [&](int pp) {
    return static_cast<rt::DeviceId>(P.mesh.rank_of(P.at.tp, P.at.cp, P.at.dp, pp));
  };
  const devices::CollectiveOptions options{
      .name = name,
      .tags = transfer_tags(t),
      .stream = stream,
      .stream_kind = stream_kind(CommGroup::pipeline),
      .element_bytes = static_cast<std::size_t>(P.shape.model.residual_stream_bytes())};
  if (me == t.from_rank) {
    const TaskId send = P.matcher.send(static_cast<rt::DeviceId>(P.rank), peer(t.to_rank),
                                       read_of(source), options);
    P.after(produced, send);
    return {send, rt::kNoTask};
  }
  const TaskId receive = P.matcher.receive(peer(t.from_rank), static_cast<rt::DeviceId>(P.rank),
                                           all_of(target), options);
  for (TaskId before : free)
    P.after(before, receive);
  return {rt::kNoTask, receive};
}

using StageMicroBatch = std::pair<int, int>;  // (model chunk, micro-batch)

// Per chunk, the last full backward or weight-gradient half (rank, index in the rank's list).
std::vector<ScheduledAction> last_backwards(const PipelineSchedule& schedule) {
  std::vector<ScheduledAction> last(static_cast<std::size_t>(schedule.stages()), {-1, -1});
  for (int pp = 0; pp < schedule.ranks; ++pp) {
    const auto& list = schedule.actions[static_cast<std::size_t>(pp)];
    for (int i = 0; i < static_cast<int>(list.size()); ++i)
      if (list[i].type == ActionType::Backward || list[i].type == ActionType::BackwardWeight)
        last[static_cast<std::size_t>(schedule.stage(pp, list[i].chunk))] = {pp, i};
  }
  return last;
}

// This rank's state of the walk over the lowered steps: the weight halves each I leaves for its
// W; by (chunk, micro-batch) the tasks after which the chunk's output is made (forward_out), its
// input has arrived (activations_in) or the gradient of its output has (gradient_in); per
// activation set what must be done before a transfer may overwrite it (the backward of the
// micro-batch that held it before) and the send that last read its d_send; and the task after
// which the word embedding's gradient is complete.
struct PipelineWalk {
  // Per chunk, the last full backward or weight-gradient half (rank, index in the rank's list):
  // the chunk's gradient buckets are complete after it.
  std::vector<ScheduledAction> last_backward;
  std::map<StageMicroBatch, std::vector<LayerWeightHalf>> pending;
  std::map<StageMicroBatch, TaskId> forward_out, activations_in, gradient_in;
  std::vector<std::vector<TaskId>> free_after;
  std::vector<TaskId> last_send;
  TaskId word_grad_done = rt::kNoTask;

  explicit PipelineWalk(const RankProgram& P)
      : last_backward(last_backwards(P.layout.schedule)),
        free_after(P.state.sets.size()),
        last_send(P.state.sets.size(), rt::kNoTask) {}

  bool completes_chunk(int chunk, const ScheduledAction& at) const {
    const ScheduledAction& last = last_backward[static_cast<std::size_t>(chunk)];
    return last.rank == at.rank && last.index == at.index;
  }
};

// Where this rank's build of chunk k's action on micro-batch mb stands.
BuildPosition position(const RankProgram& P, int k, int mb) {
  const ActivationSetPlan& sets = P.set_plan;
  const int K = P.layout.chunks(), me = P.at.pp;
  return {.micro_batch = mb,
          .chunk = k,
          .set = sets.set(me, k, mb),
          .output = k == K - 1 ? sets.output_index.at(mb) : 0,
          .tag_chunk = K > 1};
}

TaskId run_forward(RankProgram& P, PipelineWalk& walk, const BuildPosition& pos) {
  const int k = pos.chunk, mb = pos.micro_batch;
  const TaskId ready = k > 0 ? walk.activations_in.at({k, mb}) : rt::kNoTask;
  return walk.forward_out[{k, mb}] = ModelChunk(P, k).forward(pos, ready);
}

TaskId run_backward(RankProgram& P, PipelineWalk& walk, const BuildPosition& pos,
                    const ScheduledAction& at, bool split) {
  const int k = pos.chunk, mb = pos.micro_batch;
  const auto set = static_cast<std::size_t>(pos.set);
  const TaskId ready = k + 1 < P.layout.chunks() ? walk.gradient_in.at({k, mb}) : rt::kNoTask;
  const bool last = !split && walk.completes_chunk(k, at);
  WeightHalves halves(split);
  const TaskId done =
      ModelChunk(P, k).backward(pos, ready, halves, last, walk.word_grad_done, walk.last_send[set]);
  if (split) walk.pending[{k, mb}] = halves.take_for_w();
  if (done != rt::kNoTask) walk.free_after[set] = {done};
  return done;
}

TaskId run_weight_gradients(RankProgram& P, PipelineWalk& walk, const BuildPosition& pos,
                            const ScheduledAction& at) {
  const int k = pos.chunk, mb = pos.micro_batch;
  const TaskId done = ModelChunk(P, k).weight_gradients(
      std::move(walk.pending.at({k, mb})), walk.completes_chunk(k, at), walk.word_grad_done);
  walk.pending.erase({k, mb});
  // The set is free once its weight gradients have read it; they follow the I's tasks on the
  // compute stream, so they are what a later transfer into the set waits for.
  if (done != rt::kNoTask) walk.free_after[static_cast<std::size_t>(pos.set)].push_back(done);
  return done;
}

// Builds the action at `at` if this rank runs it; its last task (kNoTask otherwise).
TaskId run_action(RankProgram& P, PipelineWalk& walk, const ScheduledAction& at) {
  const PipelineSchedule& schedule = P.layout.schedule;
  const Action& a =
      schedule.actions[static_cast<std::size_t>(at.rank)][static_cast<std::size_t>(at.index)];
  if (a.type == ActionType::Idle || at.rank != P.at.pp) return rt::kNoTask;
  const BuildPosition pos = position(P, schedule.stage(at.rank, a.chunk), a.micro_batch);
  switch (a.type) {
    case ActionType::Forward:
      return run_forward(P, walk, pos);
    case ActionType::Backward:
    case ActionType::BackwardInput:
      return run_backward(P, walk, pos, at, a.type == ActionType::BackwardInput);
    case ActionType::BackwardWeight:
      return run_weight_gradients(P, walk, pos, at);
    case ActionType::Idle:
      break;
  }
  return rt::kNoTask;
}

// Both ends of an activation transfer, issued where its receiver is: the receive overwrites the
// input of an activation set, so it must follow the backward that used the set before, which
// only the receiver's place in the order is sure to be past.
void move_activations(RankProgram& P, PipelineWalk& walk, const StageTransfer& t) {
  const ActivationSetPlan& sets = P.set_plan;
  const int me = P.at.pp, mb = t.micro_batch;
  const bool sends = me == t.from_rank, receives = me == t.to_rank;
  const int from_set = sends ? sets.set(me, t.from_stage, mb) : 0;
  const int to_set = receives ? sets.set(me, t.to_stage, mb) : 0;
  const int last_layer = P.layout.end_layer(t.from_stage) - 1;
  const TransferEnds ends =
      transfer(P, t, sends ? walk.forward_out.at({t.from_stage, mb}) : rt::kNoTask,
               sends ? P.acts(from_set, last_layer).x_out : Tensor{},
               receives ? walk.free_after[static_cast<std::size_t>(to_set)] : std::vector<TaskId>{},
               receives ? P.aset(to_set).x_in : Tensor{});
  if (receives) walk.activations_in[{t.to_stage, mb}] = ends.receive;
}

// Both ends of an input-gradient transfer, issued where its sender is, right after `done` made
// it: the previous stage's set still holds this micro-batch, so nothing there must finish
// first. The set's next backward rewrites d_send only after this send has read it.
void move_gradients(RankProgram& P, PipelineWalk& walk, const StageTransfer& t, TaskId done) {
  const ActivationSetPlan& sets = P.set_plan;
  const int me = P.at.pp, mb = t.micro_batch;
  const bool sends = me == t.from_rank, receives = me == t.to_rank;
  const int from_set = sends ? sets.set(me, t.from_stage, mb) : 0;
  const TransferEnds ends =
      transfer(P, t, done, sends ? P.aset(from_set).d_send : Tensor{}, {},
               receives ? P.aset(sets.set(me, t.to_stage, mb)).d_recv : Tensor{});
  if (receives) walk.gradient_in[{t.to_stage, mb}] = ends.receive;
  if (sends && ends.send != ends.receive)
    walk.last_send[static_cast<std::size_t>(from_set)] = ends.send;
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
  const LoweredPipeline lowered = lower_transfers(P.layout.schedule);
  PipelineWalk walk(P);
  TaskId produced = rt::kNoTask;  // the last task of the step's compute action on this rank
  for (const LoweredStep& step : lowered.steps) {
    const StageTransfer* t =
        step.transfer >= 0 ? &lowered.transfers[static_cast<std::size_t>(step.transfer)] : nullptr;
    switch (step.type) {
      case LoweredStepType::Compute:
        produced = run_action(P, walk, step.action);
        break;
      case LoweredStepType::Receive:
        if (t->direction == TransferDirection::Activations) move_activations(P, walk, *t);
        break;
      case LoweredStepType::Send:
        if (t->direction == TransferDirection::Gradients) move_gradients(P, walk, *t, produced);
        break;
    }
  }
  reduce_embedding(P, walk.word_grad_done);
}

}  // namespace weave::graphs
