#include "weave/runtime/virtual_clock.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <queue>

#include "graph_data.hpp"
#include "weave/runtime/error.hpp"

namespace weave::rt {

namespace {

// A completion in simulated time; seq keeps same-time completions in the order they were
// scheduled, so a replay is the same every time.
struct Finish {
  Nanos time;
  std::uint64_t seq;
  std::uint32_t id;  // task id, or group id when `group`
  bool group;
  bool operator>(const Finish& o) const { return time != o.time ? time > o.time : seq > o.seq; }
};

// Compute tasks waiting for their device's engine: earliest ready first, then lowest id.
struct Waiting {
  Nanos ready;
  TaskId task;
  bool operator>(const Waiting& o) const {
    return ready != o.ready ? ready > o.ready : task > o.task;
  }
};

// Receives deferred completions in execute mode; the replay waits for each before going on.
class DeferralWait final : public detail::CompletionSink {
 public:
  void begin_deferral(TaskId) override {
    std::lock_guard lock(mutex_);
    done_ = false;
    error_ = nullptr;
  }
  void complete_deferred(TaskId, std::exception_ptr error) override {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }
  // False if the completion did not come within the timeout.
  bool wait(std::exception_ptr& error) {
    std::unique_lock lock(mutex_);
    const bool ok = cv_.wait_for(lock, std::chrono::seconds(60), [&] { return done_; });
    error = error_;
    return ok;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = true;
  std::exception_ptr error_;
};

class Replay {
 public:
  Replay(const detail::GraphData& g, const CostModel& model, const VirtualClockOptions& options,
         std::uint64_t run_index)
      : g_(g),
        table_(*g.table),
        model_(model),
        options_(options),
        run_index_(run_index),
        pending_(g.in_degree.begin(), g.in_degree.end()),
        start_(table_.size(), -1),
        end_(table_.size(), -1),
        group_arrived_(table_.group_count(), 0),
        group_last_arrival_(table_.group_count(), 0),
        engine_busy_(table_.device_count(), false),
        waiting_(table_.device_count()) {
    if (options_.execute) sink_ = std::make_shared<DeferralWait>();
    if (options_.faults) {
      for (TaskId t = 0; t < table_.size(); ++t) {
        const std::optional<FaultKind> kind = options_.faults->fault_for(table_, t, run_index_);
        if (!kind) continue;
        if (faults_.empty()) faults_.assign(table_.size(), 0);
        faults_[t] = static_cast<std::uint8_t>(1 + static_cast<int>(*kind));
      }
    }
  }

  Nanos run() {
    for (TaskId s : g_.sources)
      ready(s, 0);
    start_waiting(0);
    while (!events_.empty()) {
      const Nanos now = events_.top().time;
      // Everything that completes at `now` first, then the engines choose among all that
      // became ready at `now`; zero-length tasks can add more completions at `now`.
      do {
        while (!events_.empty() && events_.top().time == now) {
          const Finish c = events_.top();
          events_.pop();
          if (c.group) {
            for (TaskId m : table_.members(c.id))
              complete(m, now);
          } else {
            complete(c.id, now);
          }
        }
        start_waiting(now);
      } while (!events_.empty() && events_.top().time == now);
    }
    check_everything_ran();
    Nanos makespan = 0;
    for (Nanos e : end_)
      makespan = std::max(makespan, e);
    return makespan;
  }

  Trace trace(std::shared_ptr<const TaskTable> table) const {
    std::vector<Span> spans;
    spans.reserve(table_.size());
    for (TaskId t = 0; t < table_.size(); ++t) {
      if (start_[t] >= 0) spans.push_back(Span{t, start_[t], end_[t]});
    }
    return Trace(std::move(table), std::move(spans), ClockKind::virtual_time);
  }

 private:
  bool injected(TaskId t, FaultKind kind) const {
    return !faults_.empty() && faults_[t] == 1 + static_cast<int>(kind);
  }

  // A validated graph runs every task, so a task left unrun waited for one the fault plan held
  // back: the replay fails naming the collectives that waited and their members.
  void check_everything_ran() const {
    std::size_t unrun = 0;
    for (TaskId t = 0; t < table_.size(); ++t)
      unrun += end_[t] < 0 ? 1 : 0;
    if (unrun == 0) return;
    auto named = [&](TaskId t) {
      const bool held = std::find(held_.begin(), held_.end(), t) != held_.end();
      return fmt::format("'{}' (device {}{})", table_.name(t), table_[t].device,
                         held ? ", held back by the fault plan" : "");
    };
    std::string waits;
    for (GroupId g = 0; g < table_.group_count(); ++g) {
      const auto members = table_.members(g);
      if (group_arrived_[g] == 0 || group_arrived_[g] >= members.size()) continue;
      std::string here, missing;
      for (TaskId m : members) {
        std::string& list = start_[m] >= 0 ? here : missing;
        list += fmt::format("{}{}", list.empty() ? "" : ", ", named(m));
      }
      waits +=
          fmt::format("Collective '{}' has {} of its {} members: arrived {}; never arrived {}. ",
                      table_.group_name(g), group_arrived_[g], members.size(), here, missing);
    }
    TaskId blame = kNoTask;
    for (TaskId t = 0; t < table_.size() && blame == kNoTask; ++t)
      if (end_[t] < 0) blame = t;
    if (!held_.empty()) {
      blame = held_.front();
      std::string names;
      for (TaskId t : held_)
        names += fmt::format("{}{}", names.empty() ? "" : ", ", named(t));
      waits += fmt::format("Never started: {}. ", names);
    }
    const TaskInfo& info = table_[blame];
    throw TaskError(
        std::string(table_.name(blame)), blame, nullptr,
        fmt::format("task '{}' (device {}, stream '{}') never ran in the virtual-clock replay: {} "
                    "task(s) were left waiting. {}The replay stopped",
                    table_.name(blame), info.device, table_.stream_name(info.stream), unrun,
                    waits));
  }

  bool uses_engine(const TaskInfo& info) const {
    return options_.one_compute_engine_per_device && info.kind == TaskKind::compute;
  }

  void ready(TaskId t, Nanos now) {
    if (injected(t, FaultKind::never_arrive)) {
      held_.push_back(t);
      return;
    }
    const TaskInfo& info = table_[t];
    if (info.group != kNoGroup) {
      arrive(t, now);
    } else if (uses_engine(info)) {
      waiting_[info.device].push(Waiting{now, t});
      dirty_.push_back(info.device);
    } else {
      begin(t, now);
    }
  }

  void arrive(TaskId member, Nanos now) {
    start_[member] = now;
    const GroupId g = table_[member].group;
    group_last_arrival_[g] = std::max(group_last_arrival_[g], now);
    const auto members = table_.members(g);
    if (++group_arrived_[g] < members.size()) return;
    Nanos longest = 0;
    for (TaskId m : members)
      longest = std::max(longest, model_.duration(table_, m, execute(m)));
    events_.push(Finish{group_last_arrival_[g] + longest, seq_++, g, true});
  }

  void begin(TaskId t, Nanos now) {
    start_[t] = now;
    if (uses_engine(table_[t])) engine_busy_[table_[t].device] = true;
    const CostHint cost = execute(t);
    events_.push(Finish{now + model_.duration(table_, t, cost), seq_++, t, false});
  }

  void start_waiting(Nanos now) {
    for (DeviceId d : dirty_) {
      if (!engine_busy_[d] && !waiting_[d].empty()) {
        const TaskId t = waiting_[d].top().task;
        waiting_[d].pop();
        begin(t, now);
      }
    }
    dirty_.clear();
  }

  void complete(TaskId t, Nanos now) {
    end_[t] = now;
    const TaskInfo& info = table_[t];
    if (uses_engine(info)) {
      engine_busy_[info.device] = false;
      dirty_.push_back(info.device);
    }
    for (auto i = g_.succ_begin[t]; i < g_.succ_begin[t + 1]; ++i) {
      const TaskId s = g_.succ[i];
      if (--pending_[s] == 0) ready(s, now);
    }
  }

  // Runs the task's work (in execute mode) and returns its cost: what it reported, or its hint.
  CostHint execute(TaskId t) {
    const bool fault = injected(t, FaultKind::throw_error);
    if (!fault && !options_.execute) return table_[t].cost;
    const TaskFn& work = g_.work[t];
    if (!fault && !work) return table_[t].cost;
    std::exception_ptr error;
    TaskContext context(table_, t, run_index_, true, sink_.get());
    try {
      if (fault) throw InjectedFault(injected_fault_message(table_, t, run_index_));
      work(context);
    } catch (...) {
      error = std::current_exception();
    }
    if (!error && context.deferred() && !sink_->wait(error)) {
      error = std::make_exception_ptr(std::runtime_error(
          "the task deferred its completion and it did not come within 60 s of the replay "
          "waiting for it"));
    }
    if (error) {
      const TaskInfo& info = table_[t];
      throw TaskError(std::string(table_.name(t)), t, error,
                      fmt::format("task '{}' (device {}, stream '{}') failed in the virtual-clock "
                                  "replay: {}. The replay stopped",
                                  table_.name(t), info.device, table_.stream_name(info.stream),
                                  describe(error)));
    }
    return context.reported_cost().value_or(table_[t].cost);
  }

  const detail::GraphData& g_;
  const TaskTable& table_;
  const CostModel& model_;
  const VirtualClockOptions& options_;
  std::uint64_t run_index_;
  std::vector<std::uint32_t> pending_;
  std::vector<Nanos> start_;
  std::vector<Nanos> end_;
  std::vector<std::uint32_t> group_arrived_;
  std::vector<Nanos> group_last_arrival_;
  std::vector<bool> engine_busy_;
  std::vector<std::priority_queue<Waiting, std::vector<Waiting>, std::greater<>>> waiting_;
  std::vector<DeviceId> dirty_;
  std::priority_queue<Finish, std::vector<Finish>, std::greater<>> events_;
  std::uint64_t seq_ = 0;
  std::shared_ptr<DeferralWait> sink_;
  std::vector<std::uint8_t> faults_;  // empty: none; per task: 0, or 1 + FaultKind
  std::vector<TaskId> held_;          // tasks the fault plan kept from arriving
};

}  // namespace

VirtualClock::VirtualClock(const CostModel& model, VirtualClockOptions options)
    : model_(model), options_(options) {}

VirtualRunResult VirtualClock::run(const Graph& graph) {
  const auto& data = detail::GraphAccess::data(graph);
  Replay replay(*data, model_, options_, runs_++);
  VirtualRunResult result;
  result.makespan = replay.run();
  if (options_.record_trace) result.trace = replay.trace(graph.shared_tasks());
  return result;
}

}  // namespace weave::rt
