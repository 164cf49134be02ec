#include "weave/runtime/executor.hpp"

#include <fmt/format.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <thread>

#include "clock.hpp"
#include "device_queues.hpp"
#include "eager.hpp"
#include "graph_data.hpp"
#include "run_state.hpp"
#include "timer.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/event.hpp"
#include "weave/runtime/stream.hpp"

namespace weave::rt {

namespace {
Nanos watch_period(const RunOptions& options) {
  if (options.stall_timeout <= 0) return 100'000'000;
  return std::clamp<Nanos>(options.stall_timeout / 8, 1'000'000, 100'000'000);
}
}  // namespace

Executor::Executor(std::vector<tbb::task_arena*> arenas) {
  if (arenas.empty()) throw std::invalid_argument("an executor needs at least one device arena");
  for (std::size_t i = 0; i < arenas.size(); ++i) {
    if (!arenas[i]) throw std::invalid_argument(fmt::format("arena of device {} is null", i));
  }
  queues_ = std::make_shared<detail::DeviceQueues>(std::move(arenas));
  timer_ = std::make_unique<detail::Timer>();
  eager_ = std::make_shared<detail::EagerRegistry>(queues_);
}

Executor::~Executor() {
  // Finish eager work and let every thread leave the queues before the state they run goes.
  for (auto& s : eager_->streams()) {
    try {
      s->synchronize();
    } catch (...) {
      // An error nobody synchronised for: the stream's work is over, which is all we need.
    }
  }
  while (!queues_->quiescent())
    std::this_thread::yield();
  // Drainers enqueued but not yet started hold the queues; let them run and leave, so nothing
  // outlives the executor. Bounded: an arena no worker ever visits again must not hang us. The
  // bound is generous because a host loaded several times over its cores (a sanitized suite run
  // in parallel) can take over a second to bring a worker into an arena, and a drainer the arena
  // never runs is never destroyed either: its hold on the queues would leak.
  const Nanos deadline = detail::steady_now() + 10'000'000'000;
  while (queues_->drainers_pending() && detail::steady_now() < deadline)
    std::this_thread::yield();
  timer_.reset();
  retired_.reset();
}

std::size_t Executor::device_count() const {
  return queues_->size();
}

RunResult Executor::run(const Graph& graph, const RunOptions& options) {
  if (detail::inside_task()) {
    throw std::logic_error(
        "Executor::run() called from inside a task: a task must not wait for a whole run; "
        "build one graph or run it from the host thread");
  }
  const TaskTable& table = graph.tasks();
  if (table.device_count() > device_count()) {
    for (TaskId t = 0; t < table.size(); ++t) {
      if (table[t].device >= device_count()) {
        throw GraphError(fmt::format(
            "task '{}' is placed on device {}, but the executor has {} device(s) (0 to {}); "
            "build the graph for this many devices or give the executor more arenas",
            table.name(t), table[t].device, device_count(), device_count() - 1));
      }
    }
  }
  std::lock_guard lock(run_mutex_);
  // The previous run's state may be freed once no thread is inside the queues any more.
  if (retired_ && queues_->quiescent()) retired_.reset();

  RunOptions effective = options;
  if (faults_ && faults_->stall_timeout > 0) effective.stall_timeout = faults_->stall_timeout;
  auto state = std::make_shared<detail::RunState>(
      detail::GraphAccess::data(graph), queues_, *timer_, effective, runs_++,
      detail::InjectedFaults{faults_, faults_ ? runs_under_faults_++ : 0});
  const Nanos t0 = detail::steady_now();
  state->start();
  queues_->help_until([&] { return state->finished(); }, [&] { state->watch(); },
                      watch_period(effective));
  RunResult result;
  result.wall_time = detail::steady_now() - t0;
  retired_ = state;
  state->rethrow_if_failed();
  if (options.record_trace) result.trace = state->trace();
  return result;
}

void Executor::set_fault_plan(FaultPlan plan) {
  std::lock_guard lock(run_mutex_);
  faults_ = plan.empty() ? nullptr : std::make_shared<const FaultPlan>(std::move(plan));
  runs_under_faults_ = 0;
}

Stream Executor::stream(DeviceId device, StreamId stream) {
  return Stream(eager_->stream(device, stream));
}

Stream Executor::stream(DeviceId device, std::string_view name) {
  return Stream(eager_->stream(device, eager_->stream_id(name)));
}

void Executor::wait(const Event& event, std::uint64_t value) {
  if (detail::inside_task()) {
    throw std::logic_error(
        "Executor::wait() called from inside a task: order the task after the event with "
        "Stream::wait instead of blocking a worker");
  }
  detail::EventState& e = *event.state_;
  e.add_host_waiter(queues_.get());
  queues_->help_until(
      [&] { return e.failed.load(std::memory_order_acquire) || e.value.load() >= value; }, [] {},
      100'000'000);
  e.remove_host_waiter(queues_.get());
  if (e.value.load() < value) {
    std::lock_guard lock(e.mutex);
    throw TaskError(e.failed_task, kNoTask, nullptr,
                    fmt::format("event '{}' will not reach {}: task '{}' that was to signal it "
                                "failed: {}",
                                e.name, value, e.failed_task, e.failure));
  }
}

void Executor::begin_eager_trace() {
  eager_->begin_trace();
}
Trace Executor::end_eager_trace() {
  return eager_->end_trace();
}

}  // namespace weave::rt
