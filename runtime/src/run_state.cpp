#include "run_state.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "clock.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/fault_plan.hpp"

namespace weave::rt::detail {

namespace {
// Once a task has started its dependency counter is free; a deferred task reuses it for the
// handshake between its function returning and its Completion being completed.
constexpr std::uint32_t kDeferred = 1u << 31;
constexpr std::uint32_t kFnReturned = 1u << 30;
constexpr std::uint32_t kCompleted = 1u << 29;

bool is_data_movement(TaskKind kind) {
  return kind == TaskKind::comm || kind == TaskKind::copy;
}
}  // namespace

void ReadyBatch::flush() {
  for (std::size_t i = 0; i < size_;) {
    std::size_t j = i + 1;
    while (j < size_ && devices_[j] == devices_[i])
      ++j;
    queues_.push_batch(devices_[i], items_ + i, j - i);
    i = j;
  }
  size_ = 0;
}

RunState::RunState(std::shared_ptr<const GraphData> graph, std::shared_ptr<DeviceQueues> queues,
                   Timer& timer, const RunOptions& options, std::uint64_t run_index,
                   InjectedFaults faults)
    : graph_(std::move(graph)),
      table_(*graph_->table),
      queues_(std::move(queues)),
      timer_(timer),
      options_(options),
      run_index_(run_index),
      sinks_left_(graph_->sinks) {
  const std::size_t n = table_.size();
  pending_ = std::make_unique<std::atomic<std::uint32_t>[]>(n);
  for (std::size_t t = 0; t < n; ++t) {
    pending_[t].store(graph_->in_degree[t], std::memory_order_relaxed);
  }
  const std::size_t groups = table_.group_count();
  group_arrived_ = std::make_unique<std::atomic<std::uint32_t>[]>(groups);
  group_finished_ = std::make_unique<std::atomic<std::uint32_t>[]>(groups);
  if (options_.link_model) {
    group_last_arrival_.assign(groups, 0);
    hold_until_.assign(n, 0);
    cost_.resize(n);
  }
  if (options_.record_trace) {
    span_start_ = std::make_unique<std::uint64_t[]>(n);
    span_end_ = std::make_unique<std::uint64_t[]>(n);
  }
  if (options_.deadline > 0) running_ = std::make_unique<std::atomic<bool>[]>(n);
  if (faults.plan) {
    fault_run_ = faults.run;
    for (TaskId t = 0; t < n; ++t) {
      const std::optional<FaultKind> kind = faults.plan->fault_for(table_, t, faults.run);
      if (!kind) continue;
      if (faults_.empty()) faults_.assign(n, 0);
      faults_[t] = static_cast<std::uint8_t>(1 + static_cast<int>(*kind));
    }
  }
}

bool RunState::injected(TaskId task, FaultKind kind) const {
  return !faults_.empty() && faults_[task] == 1 + static_cast<int>(kind);
}

void RunState::start() {
  started_at_ = steady_now();
  if (options_.deadline > 0) {
    // On the timer's thread, which no task ever occupies: the run's own threads may all be
    // busy with the tasks that make it late. The state may be gone by then.
    std::weak_ptr<RunState> self = std::static_pointer_cast<RunState>(shared_from_this());
    timer_.at(
        started_at_ + options_.deadline,
        [self] {
          if (auto state = self.lock()) state->pass_deadline();
        },
        /*counted=*/false);
  }
  if (span_start_) start_ticks_ = TickClock::ticks();
  if (table_.size() == 0) {
    finished_.store(true, std::memory_order_seq_cst);
    return;
  }
  std::vector<TaskId> skipped;
  {
    ReadyBatch batch(*queues_);
    for (TaskId s : graph_->sources)
      release(s, nullptr, 0, skipped, batch);
  }
  bool last = false;
  while (!skipped.empty()) {
    const TaskId s = skipped.back();
    skipped.pop_back();
    last |= complete_one(s, nullptr, skipped);
  }
  if (last) end_run();
}

void RunState::run_item(void* self, std::uint32_t task) {
  auto* state = static_cast<RunState*>(self);
  try {
    state->execute(task);
  } catch (...) {
    // The runtime's own bookkeeping failed (out of memory, say): cancel the run with the
    // error. If completions were lost on the way, watch() ends the run once it is idle.
    state->fail(task, std::current_exception());
  }
}

bool RunState::holds(const TaskInfo& info) const {
  return options_.link_model != nullptr && is_data_movement(info.kind) &&
         !cancelled_.load(std::memory_order_relaxed);
}

void RunState::execute(TaskId task) {
  // Runs the task, then keeps running the successor it made ready on this device, if any,
  // without going through the queue.
  for (TaskId cur = task; cur != kNoTask;) {
    const TaskInfo& info = table_[cur];
    TaskId next = kNoTask;
    if (cancelled_.load(std::memory_order_acquire)) {
      work_done(cur, nullptr);  // dependents of a failure are skipped, not run
      return;
    }
    if (span_start_ && info.group == kNoGroup) span_start_[cur] = TickClock::ticks();
    const Nanos began = options_.link_model ? steady_now() : 0;
    bool deferred = false;
    {
      InsideTaskScope inside;
      TaskContext context(table_, cur, run_index_, false, this);
      if (running_) running_[cur].store(true, std::memory_order_relaxed);
      try {
        if (injected(cur, FaultKind::throw_error))
          throw InjectedFault(injected_fault_message(table_, cur, fault_run_));
        const TaskFn& work = graph_->work[cur];
        if (work) work(context);
      } catch (...) {
        fail(cur, std::current_exception());
      }
      if (running_) running_[cur].store(false, std::memory_order_relaxed);
      deferred = context.deferred();
      if (options_.link_model) cost_[cur] = context.reported_cost().value_or(info.cost);
    }
    if (info.group == kNoGroup && holds(info)) {
      // The link is busy from the task's start for what the transfer costs.
      hold_until_[cur] = began + options_.link_model->duration(table_, cur, cost_[cur]);
    }
    if (deferred) {
      const std::uint32_t before = pending_[cur].fetch_or(kFnReturned, std::memory_order_acq_rel);
      if (before & kCompleted) {
        work_done(cur, &next);
      } else {
        deferred_outstanding_.fetch_add(1, std::memory_order_seq_cst);
        if (cancelled_.load(std::memory_order_seq_cst)) try_force(cur);
      }
    } else {
      work_done(cur, &next);
    }
    cur = next;
  }
}

void RunState::begin_deferral(TaskId task) {
  pending_[task].store(kDeferred, std::memory_order_release);
}

void RunState::complete_deferred(TaskId task, std::exception_ptr error) {
  if (finished()) return;  // the run was cancelled and has ended without this task
  deferred_completions_.fetch_add(1, std::memory_order_relaxed);
  if (error) fail(task, std::move(error));
  const std::uint32_t before = pending_[task].fetch_or(kCompleted, std::memory_order_acq_rel);
  if (before & kCompleted) return;  // already abandoned by a cancellation
  if (before & kFnReturned) {
    deferred_outstanding_.fetch_sub(1, std::memory_order_seq_cst);
    work_done(task, nullptr);
  }
  // Otherwise the function has not returned yet; execute() completes the task when it does.
}

bool RunState::try_force(TaskId task) {
  std::uint32_t v = pending_[task].load(std::memory_order_acquire);
  while ((v & kDeferred) && (v & kFnReturned) && !(v & kCompleted)) {
    if (pending_[task].compare_exchange_weak(v, v | kCompleted, std::memory_order_acq_rel)) {
      deferred_outstanding_.fetch_sub(1, std::memory_order_seq_cst);
      work_done(task, nullptr);
      return true;
    }
  }
  return false;
}

void RunState::force_deferred() {
  if (deferred_outstanding_.load(std::memory_order_seq_cst) == 0) return;
  for (TaskId t = 0; t < table_.size(); ++t)
    try_force(t);
}

void RunState::work_done(TaskId task, TaskId* bypass) {
  const TaskInfo& info = table_[task];
  if (info.group != kNoGroup) {
    const auto size = static_cast<std::uint32_t>(table_.members(info.group).size());
    if (group_finished_[info.group].fetch_add(1, std::memory_order_acq_rel) + 1 == size) {
      group_done(info.group);
    }
    return;
  }
  if (holds(info)) {
    const Nanos until = hold_until_[task];
    if (steady_now() < until) {
      auto self = std::static_pointer_cast<RunState>(shared_from_this());
      timer_.at(until, [self, task] { self->finish(task, nullptr); });
      return;
    }
  }
  finish(task, bypass);
}

void RunState::group_done(GroupId group) {
  const auto members = table_.members(group);
  Nanos longest = -1;
  for (TaskId m : members) {
    if (holds(table_[m]))
      longest = std::max(longest, options_.link_model->duration(table_, m, cost_[m]));
  }
  if (longest >= 0) {
    // The transfer began when the last member arrived: a DMA engine starts then.
    const Nanos until = group_last_arrival_[group] + longest;
    if (steady_now() < until) {
      auto self = std::static_pointer_cast<RunState>(shared_from_this());
      timer_.at(until, [self, group] { self->finish_group(group); });
      return;
    }
  }
  finish_group(group);
}

void RunState::finish_group(GroupId group) {
  std::vector<TaskId> skipped;
  bool last = false;
  for (TaskId m : table_.members(group))
    last |= complete_one(m, nullptr, skipped);
  drain_skipped(skipped, last);
}

void RunState::finish(TaskId task, TaskId* bypass) {
  std::vector<TaskId> skipped;
  const bool last = complete_one(task, bypass, skipped);
  drain_skipped(skipped, last);
}

void RunState::drain_skipped(std::vector<TaskId>& skipped, bool last) {
  // Skipped tasks complete here, iteratively: a cancelled chain of a million tasks must not
  // recurse a million deep.
  while (!skipped.empty()) {
    const TaskId s = skipped.back();
    skipped.pop_back();
    last |= complete_one(s, nullptr, skipped);
  }
  if (last) end_run();  // the last touch of this run's state
}

bool RunState::complete_one(TaskId task, TaskId* bypass, std::vector<TaskId>& skipped) {
  if (span_end_) span_end_[task] = TickClock::ticks();
  const GraphData& g = *graph_;
  const DeviceId here = table_[task].device;
  const auto begin = g.succ_begin[task], end = g.succ_begin[task + 1];
  {
    ReadyBatch batch(*queues_);
    for (auto i = begin; i < end; ++i) {
      const TaskId s = g.succ[i];
      if (pending_[s].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        release(s, bypass, here, skipped, batch);
      }
    }
  }
  return begin == end && sinks_left_.fetch_sub(1, std::memory_order_acq_rel) == 1;
}

void RunState::release(TaskId ready, TaskId* bypass, DeviceId here, std::vector<TaskId>& skipped,
                       ReadyBatch& batch) {
  if (injected(ready, FaultKind::never_arrive) && hold_back(ready)) return;
  const TaskInfo& info = table_[ready];
  if (info.group != kNoGroup) {
    arrive(ready, skipped);
    return;
  }
  if (cancelled_.load(std::memory_order_acquire)) {
    skipped.push_back(ready);
    return;
  }
  // Run it next on this thread unless communication is waiting on this device: that goes
  // first so other devices are not held up behind a long run of compute.
  if (bypass && *bypass == kNoTask && info.device == here &&
      queues_->queue(here).urgent_queued.load(std::memory_order_relaxed) == 0) {
    *bypass = ready;
    return;
  }
  batch.add(info.device, item(ready));
}

void RunState::arrive(TaskId member, std::vector<TaskId>& skipped) {
  if (span_start_) span_start_[member] = TickClock::ticks();
  const GroupId group = table_[member].group;
  const auto members = table_.members(group);
  if (group_arrived_[group].fetch_add(1, std::memory_order_acq_rel) + 1 < members.size()) return;
  if (options_.link_model) group_last_arrival_[group] = steady_now();
  if (cancelled_.load(std::memory_order_acquire)) {
    skipped.insert(skipped.end(), members.begin(), members.end());
    return;
  }
  for (TaskId m : members)
    queues_->push(table_[m].device, item(m));
}

WorkItem RunState::item(TaskId task) {
  return WorkItem{&RunState::run_item, this, task, table_[task].kind != TaskKind::compute};
}

void RunState::fail(TaskId task, std::exception_ptr error) {
  {
    std::lock_guard lock(error_mutex_);
    if (!error_) {
      error_ = std::move(error);
      failed_task_ = task;
    } else {
      ++other_failures_;
    }
  }
  if (!cancelled_.exchange(true, std::memory_order_seq_cst)) {
    force_deferred();
    release_held_back();
  }
}

bool RunState::hold_back(TaskId task) {
  std::lock_guard lock(held_back_mutex_);
  // A cancellation that has already released the held-back tasks would never see this one.
  if (cancelled_.load(std::memory_order_seq_cst)) return false;
  held_back_.push_back(task);
  return true;
}

void RunState::release_held_back() {
  std::vector<TaskId> tasks;
  {
    std::lock_guard lock(held_back_mutex_);
    tasks.swap(held_back_);
  }
  std::vector<TaskId> skipped;
  for (TaskId t : tasks) {
    if (table_[t].group != kNoGroup) {
      arrive(t, skipped);  // the last member to arrive skips the whole collective
    } else {
      skipped.push_back(t);
    }
  }
  drain_skipped(skipped, false);
}

void RunState::end_run() {
  auto queues = queues_;  // this state may be released once finished_ is seen
  finished_.store(true, std::memory_order_seq_cst);
  queues->wake_helpers();
}

void RunState::pass_deadline() {
  if (finished() || cancelled_.load(std::memory_order_seq_cst)) return;
  TaskId blame = kNoTask;
  const std::string waits = outstanding(blame);
  // With nothing to blame (what is left is ready and queued), the first task stands for the run.
  fail(blame == kNoTask ? 0 : blame,
       std::make_exception_ptr(std::runtime_error(fmt::format(
           "the run passed its deadline of {:.3f} s (RunOptions::deadline) and was cancelled. "
           "{}Raise RunOptions::deadline if the run is expected to take longer",
           static_cast<double>(options_.deadline) * 1e-9, waits))));
}

void RunState::watch() {
  if (finished() || options_.stall_timeout <= 0) return;
  const Nanos now = steady_now();
  const bool cancelled = cancelled_.load(std::memory_order_seq_cst);
  const std::uint64_t progress =
      queues_->total_pops() + deferred_completions_.load(std::memory_order_relaxed);
  if (progress != last_progress_ || timer_.pending() > 0 || !queues_->quiescent()) {
    last_progress_ = progress;
    stalled_since_ = -1;
    return;
  }
  if (stalled_since_ < 0) {
    stalled_since_ = now;
    return;
  }
  if (now - stalled_since_ < options_.stall_timeout) return;
  if (cancelled) {
    // A failed run with nothing left running that still has not drained: its error is
    // recorded, so end it rather than wait for completions that will not come.
    end_run();
    return;
  }
  TaskId blame = kNoTask;
  const std::string waits = outstanding(blame);
  if (blame == kNoTask) return;  // nothing identifiable waits: ready work not yet picked up
  fail(blame, std::make_exception_ptr(std::runtime_error(fmt::format(
                  "the run stalled: for {:.3f} s no task ran or completed. {}Make sure every "
                  "collective member and every deferred Completion can finish, or raise "
                  "RunOptions::stall_timeout if the wait is expected",
                  static_cast<double>(now - stalled_since_) * 1e-9, waits))));
}

bool RunState::released(TaskId task) const {
  // Before a task starts its counter holds its predecessors not yet completed; after, at most
  // the deferral bits.
  return (pending_[task].load(std::memory_order_acquire) &
          ~(kDeferred | kFnReturned | kCompleted)) == 0;
}

std::string RunState::outstanding(TaskId& blame) const {
  constexpr std::size_t kShown = 8;
  auto named = [&](TaskId t, const char* note = "") {
    return fmt::format("'{}' (device {}{})", table_.name(t), table_[t].device, note);
  };
  std::vector<TaskId> held;
  {
    std::lock_guard lock(held_back_mutex_);
    held = held_back_;
  }
  auto is_held = [&](TaskId t) { return std::find(held.begin(), held.end(), t) != held.end(); };
  std::string out;

  // Collectives some members reached while others never arrived.
  std::size_t partial = 0;
  for (GroupId g = 0; g < table_.group_count(); ++g) {
    const std::uint32_t arrived = group_arrived_[g].load(std::memory_order_acquire);
    const auto members = table_.members(g);
    if (arrived == 0 || arrived >= members.size()) continue;
    if (++partial > kShown) continue;
    std::string here, missing;
    for (TaskId m : members) {
      if (released(m) && !is_held(m)) {
        here += fmt::format("{}{}", here.empty() ? "" : ", ", named(m));
      } else {
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ",
                               named(m, is_held(m) ? ", held back by the fault plan" : ""));
        if (blame == kNoTask) blame = m;
      }
    }
    out += fmt::format("Collective '{}' has {} of its {} members: arrived {}; never arrived {}. ",
                       table_.group_name(g), arrived, members.size(), here, missing);
  }
  if (partial > kShown) out += fmt::format("{} more collectives wait likewise. ", partial - kShown);

  // Deferred tasks whose Completion never came.
  std::vector<TaskId> waiting;
  for (TaskId t = 0; t < table_.size(); ++t) {
    const std::uint32_t v = pending_[t].load(std::memory_order_acquire);
    if ((v & kDeferred) && (v & kFnReturned) && !(v & kCompleted)) waiting.push_back(t);
  }
  if (!waiting.empty()) {
    if (blame == kNoTask) blame = waiting.front();
    std::string names;
    for (std::size_t i = 0; i < std::min(waiting.size(), kShown); ++i)
      names += fmt::format("{}{}", i ? ", " : "", named(waiting[i]));
    if (waiting.size() > kShown) names += fmt::format(" and {} more", waiting.size() - kShown);
    out +=
        fmt::format("{} deferred task(s) waited for their Completion: {}. ", waiting.size(), names);
  }

  // Tasks held back that are not collective members.
  std::string alone;
  for (TaskId t : held) {
    if (table_[t].group != kNoGroup) continue;
    if (blame == kNoTask) blame = t;
    alone += fmt::format("{}{}", alone.empty() ? "" : ", ", named(t));
  }
  if (!alone.empty()) out += fmt::format("Held back by the fault plan, never started: {}. ", alone);
  // What the fault plan held back is the cause of what waits for it.
  if (!held.empty()) blame = held.front();

  if (running_) {
    std::vector<TaskId> busy;
    for (TaskId t = 0; t < table_.size(); ++t)
      if (running_[t].load(std::memory_order_relaxed)) busy.push_back(t);
    if (!busy.empty()) {
      if (blame == kNoTask) blame = busy.front();
      std::string names;
      for (std::size_t i = 0; i < std::min(busy.size(), kShown); ++i)
        names += fmt::format("{}{}", i ? ", " : "", named(busy[i]));
      if (busy.size() > kShown) names += fmt::format(" and {} more", busy.size() - kShown);
      out += fmt::format("Still running: {}. ", names);
    }
  }
  return out;
}

void RunState::rethrow_if_failed() const {
  std::lock_guard lock(error_mutex_);
  if (!error_) return;
  const TaskInfo& info = table_[failed_task_];
  std::string message =
      fmt::format("task '{}' (device {}, stream '{}') failed: {}", table_.name(failed_task_),
                  info.device, table_.stream_name(info.stream), describe(error_));
  if (other_failures_ > 0) message += fmt::format(" ({} more task(s) failed)", other_failures_);
  message += ". The run was cancelled: tasks that depend on it did not run";
  throw TaskError(std::string(table_.name(failed_task_)), failed_task_, error_, message);
}

Trace RunState::trace() const {
  std::vector<Span> spans;
  if (!span_start_) return Trace(graph_->table, std::move(spans), ClockKind::wall);
  const double scale = TickClock::ns_per_tick();
  auto to_ns = [&](std::uint64_t ticks) {
    return static_cast<Nanos>(static_cast<double>(ticks - start_ticks_) * scale);
  };
  for (TaskId t = 0; t < table_.size(); ++t) {
    if (span_start_[t] == 0 || span_end_[t] == 0) continue;
    spans.push_back(Span{t, to_ns(span_start_[t]), to_ns(span_end_[t])});
  }
  return Trace(graph_->table, std::move(spans), ClockKind::wall);
}

}  // namespace weave::rt::detail
