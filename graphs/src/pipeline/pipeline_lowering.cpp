#include "weave/graphs/pipeline_lowering.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <optional>
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

// A lowered action: its task and the rank it runs on.
struct Placed {
  rt::TaskId task = rt::kNoTask;
  int rank = -1;
  bool done() const { return task != rt::kNoTask; }
};

class Lowering {
 public:
  Lowering(const PipelineSchedule& s, const LoweringOptions& o, rt::GraphBuilder& builder)
      : s_(s),
        o_(o),
        builder_(builder),
        send_stream_(builder.stream("p2p-send")),
        receive_stream_(builder.stream("p2p-recv")),
        cells_(static_cast<std::size_t>(s.stages() * s.micro_batches)),
        forward_(cells_),
        gradient_(cells_),
        forward_send_(cells_, rt::kNoTask),
        gradient_send_(cells_, rt::kNoTask) {
    if (o_.work) shared_work_ = std::make_shared<const PipelineActionWork>(o_.work);
  }

  // Emits the actions in emission_order: a send sits right after its producer and a receive
  // right before its consumer, so they never delay anything.
  LoweredSchedule run() {
    LoweredSchedule out;
    out_ = &out;
    out.tasks.resize(static_cast<std::size_t>(s_.ranks));
    for (const ScheduledAction& at : emission_order(s_))
      if (!emit(at.rank,
                s_.actions[static_cast<std::size_t>(at.rank)][static_cast<std::size_t>(at.index)]))
        throw std::logic_error("emission_order placed an action before its input");
    return out;
  }

 private:
  std::size_t cell(int stage, int mb) const {
    return static_cast<std::size_t>(stage * s_.micro_batches + mb);
  }

  // The input `a` waits for from another stage, if any: the previous stage's forward for a
  // forward, the next stage's input gradient for a full or input-gradient backward.
  std::optional<std::size_t> input_cell(const Action& a, int stage) const {
    if (a.type == ActionType::Forward && stage > 0) return cell(stage - 1, a.micro_batch);
    if ((a.type == ActionType::Backward || a.type == ActionType::BackwardInput) &&
        stage + 1 < s_.stages())
      return cell(stage + 1, a.micro_batch);
    return std::nullopt;
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

  // Adds `a` on `rank` if its inputs exist; false if it must wait for another rank.
  bool emit(int rank, const Action& a) {
    auto& tasks = out_->tasks[static_cast<std::size_t>(rank)];
    if (a.type == ActionType::Idle) {
      tasks.push_back(rt::kNoTask);
      return true;
    }
    const int stage = s_.stage(rank, a.chunk);
    const std::size_t own = cell(stage, a.micro_batch);
    const auto input = input_cell(a, stage);
    const Placed* producer = nullptr;
    if (input) {
      producer = a.type == ActionType::Forward ? &forward_[*input] : &gradient_[*input];
      if (!producer->done()) return false;
    }
    // The checker has made sure a backward's forward and a W's I came earlier on this rank.
    const rt::DeviceId device = static_cast<rt::DeviceId>(rank);
    const std::string name = task_name(rank, a);
    rt::TaskId receive = rt::kNoTask;
    if (producer && producer->rank != rank) {
      const rt::TaskId send =
          a.type == ActionType::Forward ? forward_send_[*input] : gradient_send_[*input];
      receive = builder_.add({.device = device,
                              .stream = receive_stream_,
                              .kind = rt::TaskKind::comm,
                              .name = fmt::format("{}.recv<r{}", name, producer->rank),
                              .tags = tags(a, stage)});
      builder_.precede(send, receive);
      out_->transfers.push_back({send, receive, producer->rank, rank});
    }
    const rt::TaskId task = builder_.add({.device = device,
                                          .stream = rt::kComputeStream,
                                          .kind = rt::TaskKind::compute,
                                          .name = name,
                                          .tags = tags(a, stage),
                                          .cost = {.flops = flops_of(a.type, o_)}},
                                         work_for(rank, a));
    tasks.push_back(task);
    if (receive != rt::kNoTask)
      builder_.precede(receive, task);
    else if (producer)
      builder_.precede(producer->task, task);
    switch (a.type) {
      case ActionType::Forward:
        forward_[own] = {task, rank};
        if (stage + 1 < s_.stages()) forward_send_[own] = send_to(task, rank, stage + 1, a, stage);
        break;
      case ActionType::Backward:
      case ActionType::BackwardInput:
        builder_.precede(forward_[own].task, task);
        gradient_[own] = {task, rank};
        if (stage > 0) gradient_send_[own] = send_to(task, rank, stage - 1, a, stage);
        break;
      case ActionType::BackwardWeight:
        builder_.precede(gradient_[own].task, task);
        break;
      case ActionType::Idle:
        break;
    }
    return true;
  }

  // The send of `producer`'s output to the rank of stage `to`, or kNoTask if that is `rank`.
  rt::TaskId send_to(rt::TaskId producer, int rank, int to, const Action& a, int stage) {
    const int peer = s_.rank_of(to);
    if (peer == rank) return rt::kNoTask;
    const double bytes = o_.transfer_bytes;
    const rt::TaskId send =
        builder_.add({.device = static_cast<rt::DeviceId>(rank),
                      .stream = send_stream_,
                      .kind = rt::TaskKind::comm,
                      .name = fmt::format("{}.send>r{}", task_name(rank, a), peer),
                      .tags = tags(a, stage),
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
  std::size_t cells_;
  // Per (stage, micro-batch): the forward and the gradient-producing backward (B or I), and
  // their sends to another rank.
  std::vector<Placed> forward_, gradient_;
  std::vector<rt::TaskId> forward_send_, gradient_send_;
  std::shared_ptr<const PipelineActionWork> shared_work_;
  LoweredSchedule* out_ = nullptr;
};

}  // namespace

std::vector<ScheduledAction> emission_order(const PipelineSchedule& s) {
  const auto cells = static_cast<std::size_t>(s.stages() * s.micro_batches);
  auto cell = [&](int stage, int mb) {
    return static_cast<std::size_t>(stage * s.micro_batches + mb);
  };
  std::vector<bool> forward_done(cells, false), gradient_done(cells, false);
  // Whether the input `a` waits for from another stage is there: the previous stage's forward
  // for a forward, the next stage's input gradient for a full or input-gradient backward.
  auto ready = [&](const Action& a, int stage) {
    if (a.type == ActionType::Forward && stage > 0)
      return static_cast<bool>(forward_done[cell(stage - 1, a.micro_batch)]);
    if ((a.type == ActionType::Backward || a.type == ActionType::BackwardInput) &&
        stage + 1 < s.stages())
      return static_cast<bool>(gradient_done[cell(stage + 1, a.micro_batch)]);
    return true;
  };
  std::vector<ScheduledAction> order;
  std::vector<std::size_t> next(static_cast<std::size_t>(s.ranks), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.ranks; ++r) {
      const auto& list = s.actions[static_cast<std::size_t>(r)];
      while (next[r] < list.size()) {
        const Action& a = list[next[r]];
        if (a.type != ActionType::Idle) {
          const int stage = s.stage(r, a.chunk);
          if (!ready(a, stage)) break;
          if (a.type == ActionType::Forward) forward_done[cell(stage, a.micro_batch)] = true;
          if (a.type == ActionType::Backward || a.type == ActionType::BackwardInput)
            gradient_done[cell(stage, a.micro_batch)] = true;
        }
        order.push_back({r, static_cast<int>(next[r])});
        ++next[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < s.ranks; ++r)
    if (next[r] != s.actions[static_cast<std::size_t>(r)].size())
      throw ScheduleError(
          fmt::format("cannot order schedule '{}': rank {} cannot get past step {}; check it with "
                      "simulate_schedule (weave schedule --load-csv) first",
                      s.name, r, next[r]));
  return order;
}

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
