#include "weave/graphs/pipeline_lowering.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <string>

#include "weave/graphs/pipeline_schedule_simulation.hpp"
#include "weave/runtime/trace_metrics.hpp"
#include "weave/runtime/virtual_clock.hpp"

namespace weave::graphs {

namespace {

rt::Phase phase_of(ActionType type) {
  switch (type) {
    case ActionType::Forward:
      return rt::Phase::forward;
    case ActionType::Backward:
    case ActionType::BackwardInput:
      return rt::Phase::backward;
    case ActionType::BackwardWeight:
      return rt::Phase::weight;
    case ActionType::Idle:
      break;
  }
  return rt::Phase::none;
}

double flops_of(ActionType type, const LoweringOptions& o) {
  switch (type) {
    case ActionType::Forward:
      return o.forward_flops;
    case ActionType::Backward:
      return o.backward_flops;
    case ActionType::BackwardInput:
      return o.backward_input_flops;
    case ActionType::BackwardWeight:
      return o.backward_weight_flops;
    case ActionType::Idle:
      break;
  }
  return 0;
}

// "r1.F3.c0"
std::string task_name(int rank, const Action& a) {
  return fmt::format("r{}.{}{}.c{}", rank, action_letter(a.type), a.micro_batch, a.chunk);
}

// Builds the tasks of the lowered steps: one compute task per action, and a send and a receive
// task per transfer between ranks. A transfer within a rank is a plain edge.
class Lowering {
 public:
  Lowering(const PipelineSchedule& s, const LoweringOptions& o, rt::GraphBuilder& builder)
      : s_(s),
        o_(o),
        builder_(builder),
        send_stream_(builder.stream("p2p-send")),
        receive_stream_(builder.stream("p2p-recv")),
        forward_(static_cast<std::size_t>(s.stages() * s.micro_batches), rt::kNoTask),
        gradient_(forward_.size(), rt::kNoTask) {
    if (o_.work) shared_work_ = std::make_shared<const PipelineActionWork>(o_.work);
  }

  // Emits the steps in their order: a send sits right after its producer and a receive right
  // before its consumer, so they never delay anything.
  LoweredSchedule run() {
    const LoweredPipeline lowered = lower_transfers(s_);
    LoweredSchedule out;
    out.tasks.resize(static_cast<std::size_t>(s_.ranks));
    // Per transfer: the send, or within a rank the producing task itself.
    std::vector<rt::TaskId> sent(lowered.transfers.size(), rt::kNoTask);
    rt::TaskId input = rt::kNoTask, produced = rt::kNoTask;
    for (const LoweredStep& step : lowered.steps) {
      const Action& a = action_of(step.action);
      switch (step.type) {
        case LoweredStepType::Receive:
          input = receive(step, lowered.transfers[step.transfer], a, sent, out);
          break;
        case LoweredStepType::Compute:
          produced = compute(step.action.rank, a, input, out);
          input = rt::kNoTask;
          break;
        case LoweredStepType::Send:
          sent[static_cast<std::size_t>(step.transfer)] =
              send(lowered.transfers[step.transfer], a, produced);
          break;
      }
    }
    return out;
  }

 private:
  const Action& action_of(const ScheduledAction& at) const {
    return s_.actions[static_cast<std::size_t>(at.rank)][static_cast<std::size_t>(at.index)];
  }

  std::size_t cell(int stage, int mb) const {
    return static_cast<std::size_t>(stage * s_.micro_batches + mb);
  }

  rt::TaskFn work_for(int rank, const Action& a) const {
    rt::MemoryTracker* memory = o_.chunk_activation_bytes > 0 ? o_.memory : nullptr;
    if (!memory && !shared_work_) return {};
    const bool allocates = a.type == ActionType::Forward;
    const bool releases = a.type == ActionType::Backward || a.type == ActionType::BackwardWeight;
    const std::int64_t bytes = o_.chunk_activation_bytes;
    return
        [memory, allocates, releases, bytes, work = shared_work_, a, rank](rt::TaskContext& ctx) {
          if (memory && allocates)
            memory->allocated(ctx.device(), rt::MemoryCategory::activations, bytes);
          if (work) (*work)(a, rank);
          if (memory && releases)
            memory->released(ctx.device(), rt::MemoryCategory::activations, bytes);
        };
  }

  rt::TaskTags tags(const Action& a, int stage) const {
    return {.micro_batch = a.micro_batch,
            .virtual_stage = stage,
            .chunk = a.chunk,
            .phase = phase_of(a.type)};
  }

  // The task `consumer` waits for to have transfer `t`: a receive after the send, or within a
  // rank the producing task.
  rt::TaskId receive(const LoweredStep& step, const StageTransfer& t, const Action& consumer,
                     const std::vector<rt::TaskId>& sent, LoweredSchedule& out) {
    const rt::TaskId send = sent[static_cast<std::size_t>(step.transfer)];
    if (t.local()) return send;
    const int rank = step.action.rank;
    const rt::TaskId receive =
        builder_.add({.device = static_cast<rt::DeviceId>(rank),
                      .stream = receive_stream_,
                      .kind = rt::TaskKind::comm,
                      .name = fmt::format("{}.recv<r{}", task_name(rank, consumer), t.from_rank),
                      .tags = tags(consumer, t.to_stage)});
    builder_.precede(send, receive);
    out.transfers.push_back({send, receive, t.from_rank, t.to_rank});
    return receive;
  }

  // The compute task of `a`, after `input` (what another stage sent it, if anything) and after
  // what the rank itself ran for it before (a backward's forward, a W's I, which the checker has
  // made sure came earlier on this rank).
  rt::TaskId compute(int rank, const Action& a, rt::TaskId input, LoweredSchedule& out) {
    auto& tasks = out.tasks[static_cast<std::size_t>(rank)];
    if (a.type == ActionType::Idle) {
      tasks.push_back(rt::kNoTask);
      return rt::kNoTask;
    }
    const int stage = s_.stage(rank, a.chunk);
    const std::size_t own = cell(stage, a.micro_batch);
    const rt::TaskId task = builder_.add({.device = static_cast<rt::DeviceId>(rank),
                                          .stream = rt::kComputeStream,
                                          .kind = rt::TaskKind::compute,
                                          .name = task_name(rank, a),
                                          .tags = tags(a, stage),
                                          .cost = {.flops = flops_of(a.type, o_)}},
                                         work_for(rank, a));
    tasks.push_back(task);
    if (input != rt::kNoTask) builder_.precede(input, task);
    switch (a.type) {
      case ActionType::Forward:
        forward_[own] = task;
        break;
      case ActionType::Backward:
      case ActionType::BackwardInput:
        builder_.precede(forward_[own], task);
        gradient_[own] = task;
        break;
      case ActionType::BackwardWeight:
        builder_.precede(gradient_[own], task);
        break;
      case ActionType::Idle:
        break;
    }
    return task;
  }

  // The send of `t` after `producer` (the task of `a`), or within a rank `producer` itself.
  rt::TaskId send(const StageTransfer& t, const Action& a, rt::TaskId producer) {
    if (t.local()) return producer;
    const double bytes = o_.transfer_bytes;
    const rt::TaskId send =
        builder_.add({.device = static_cast<rt::DeviceId>(t.from_rank),
                      .stream = send_stream_,
                      .kind = rt::TaskKind::comm,
                      .name = fmt::format("{}.send>r{}", task_name(t.from_rank, a), t.to_rank),
                      .tags = tags(a, t.from_stage),
                      .cost = {.bytes = bytes, .messages = bytes > 0 ? 1u : 0u}});
    builder_.precede(producer, send);
    return send;
  }

  const PipelineSchedule& s_;
  const LoweringOptions& o_;
  rt::GraphBuilder& builder_;
  // Sends and receives queue apart, as on a full-duplex link: a receive never waits behind
  // an unrelated outgoing send.
  rt::StreamId send_stream_;
  rt::StreamId receive_stream_;
  // Per (stage, micro-batch): the forward and the gradient-making backward (B or I).
  std::vector<rt::TaskId> forward_, gradient_;
  std::shared_ptr<const PipelineActionWork> shared_work_;
};

}  // namespace

LoweredSchedule lower_schedule(const PipelineSchedule& schedule, const LoweringOptions& options,
                               rt::GraphBuilder& builder) {
  const ScheduleReport check = simulate_schedule(schedule);
  if (!check.simulated) {
    std::string problems;
    for (const std::string& problem : check.problems)
      problems += fmt::format("\n  {}", problem);
    throw ScheduleError(fmt::format(
        "cannot lower schedule '{}' to a task graph: a schedule must pass the checker and its "
        "dry run first; fix these:{}",
        schedule.name, problems));
  }
  return Lowering(schedule, options, builder).run();
}

PipelineReplay replay_schedule(const PipelineSchedule& schedule, LoweringOptions options,
                               const rt::CostModel& model) {
  if (options.chunk_activation_bytes <= 0) options.chunk_activation_bytes = 1;
  rt::MemoryTracker memory(static_cast<std::size_t>(std::max(schedule.ranks, 1)));
  options.memory = &memory;
  rt::GraphBuilder builder;
  lower_schedule(schedule, options, builder);
  const rt::Graph graph = builder.build();
  rt::VirtualClock clock(model, {.execute = true});
  rt::VirtualRunResult run = clock.run(graph);

  PipelineReplay replay;
  replay.makespan = run.makespan;
  const rt::TraceMetrics metrics = rt::measure(run.trace);
  const double micro_batch_bytes =
      static_cast<double>(options.chunk_activation_bytes) * schedule.chunks;
  double busy = 0, idle = 0;
  for (int r = 0; r < schedule.ranks; ++r) {
    const auto device = static_cast<std::size_t>(r);
    const rt::Nanos rank_busy =
        device < metrics.devices.size() ? metrics.devices[device].compute_busy : 0;
    replay.busy.push_back(rank_busy);
    busy += static_cast<double>(rank_busy);
    idle += static_cast<double>(run.makespan - rank_busy);
    replay.peak_activations.push_back(
        static_cast<double>(
            memory.peak(static_cast<rt::DeviceId>(r), rt::MemoryCategory::activations)) /
        micro_batch_bytes);
  }
  replay.bubble_over_ideal = busy > 0 ? idle / busy : 0;
  replay.idle_over_total =
      run.makespan > 0 ? idle / (schedule.ranks * static_cast<double>(run.makespan)) : 0;
  replay.trace = std::move(run.trace);
  return replay;
}

}  // namespace weave::graphs
