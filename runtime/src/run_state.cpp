#include "run_state.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "clock.hpp"
#include "weave/runtime/error.hpp"

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
                   Timer& timer, const RunOptions& options, std::uint64_t run_index)
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
}

void RunState::start() {
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
      try {
        const TaskFn& work = graph_->work[cur];
        if (work) work(context);
      } catch (...) {
        fail(cur, std::current_exception());
      }
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
  if (!cancelled_.exchange(true, std::memory_order_seq_cst)) force_deferred();
}

void RunState::end_run() {
  auto queues = queues_;  // this state may be released once finished_ is seen
  finished_.store(true, std::memory_order_seq_cst);
  queues->wake_helpers();
}

void RunState::watch() {
  if (options_.stall_timeout <= 0 || finished()) return;
  const std::uint64_t progress =
      queues_->total_pops() + deferred_completions_.load(std::memory_order_relaxed);
  const Nanos now = steady_now();
  const bool cancelled = cancelled_.load(std::memory_order_seq_cst);
  if (progress != last_progress_ || timer_.pending() > 0 || !queues_->quiescent() ||
      (!cancelled && deferred_outstanding_.load(std::memory_order_seq_cst) == 0)) {
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

  std::vector<TaskId> waiting;
  for (TaskId t = 0; t < table_.size(); ++t) {
    const std::uint32_t v = pending_[t].load(std::memory_order_acquire);
    if ((v & kDeferred) && (v & kFnReturned) && !(v & kCompleted)) waiting.push_back(t);
  }
  if (waiting.empty()) return;
  std::string names;
  for (std::size_t i = 0; i < std::min<std::size_t>(waiting.size(), 8); ++i) {
    names += fmt::format("{}'{}'", i ? ", " : "", table_.name(waiting[i]));
  }
  if (waiting.size() > 8) names += fmt::format(" and {} more", waiting.size() - 8);
  fail(waiting.front(),
       std::make_exception_ptr(std::runtime_error(fmt::format(
           "the run stalled: for {:.3f} s no task ran or completed while {} deferred task(s) "
           "waited for their Completion: {}. Complete or fail each deferred Completion, or "
           "raise RunOptions::stall_timeout if the wait is expected",
           static_cast<double>(now - stalled_since_) * 1e-9, waiting.size(), names))));
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
