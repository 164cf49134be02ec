#include "eager.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "clock.hpp"
#include "weave/runtime/error.hpp"
#include "weave/runtime/event.hpp"
#include "weave/runtime/stream.hpp"

namespace weave::rt {

// ------------------------------------------------------------------------------- EventState

namespace detail {

void EventState::wake(std::vector<std::shared_ptr<EagerStream>>& ready,
                      std::vector<DeviceQueues*>& hosts) {
  for (auto& s : ready)
    s->resume();
  for (DeviceQueues* q : hosts)
    q->wake_helpers();
}

void EventState::signal(std::uint64_t v) {
  std::vector<std::shared_ptr<EagerStream>> ready;
  std::vector<DeviceQueues*> hosts;
  {
    std::lock_guard lock(mutex);
    const std::uint64_t now = value.load(std::memory_order_relaxed);
    if (v <= now) {
      throw std::invalid_argument(fmt::format(
          "event '{}' is at {} and cannot be signalled to {}: a timeline only grows; signal a "
          "value above {}",
          name, now, v, now));
    }
    value.store(v, std::memory_order_release);
    for (std::size_t i = 0; i < parked.size();) {
      if (parked[i].first <= v) {
        ready.push_back(std::move(parked[i].second));
        parked[i] = std::move(parked.back());
        parked.pop_back();
      } else {
        ++i;
      }
    }
    hosts = host_waiters;
  }
  wake(ready, hosts);
}

void EventState::fail(const std::string& task, const std::string& why) {
  std::vector<std::shared_ptr<EagerStream>> ready;
  std::vector<DeviceQueues*> hosts;
  {
    std::lock_guard lock(mutex);
    if (!failed.load(std::memory_order_relaxed)) {
      failure = why;
      failed_task = task;
    }
    failed.store(true, std::memory_order_release);
    for (auto& p : parked)
      ready.push_back(std::move(p.second));
    parked.clear();
    hosts = host_waiters;
  }
  wake(ready, hosts);
}

bool EventState::park(std::uint64_t v, std::shared_ptr<EagerStream> stream) {
  std::lock_guard lock(mutex);
  if (failed.load(std::memory_order_relaxed) || value.load(std::memory_order_relaxed) >= v) {
    return false;
  }
  parked.emplace_back(v, std::move(stream));
  return true;
}

void EventState::add_host_waiter(DeviceQueues* queues) {
  std::lock_guard lock(mutex);
  host_waiters.push_back(queues);
}

void EventState::remove_host_waiter(DeviceQueues* queues) {
  std::lock_guard lock(mutex);
  auto it = std::find(host_waiters.begin(), host_waiters.end(), queues);
  if (it != host_waiters.end()) host_waiters.erase(it);
}

// ------------------------------------------------------------------------------ EagerStream

EagerStream::EagerStream(DeviceId device, StreamId id, std::shared_ptr<DeviceQueues> queues,
                         EagerRegistry& registry)
    : device_(device), id_(id), queues_(std::move(queues)), registry_(registry) {}

void EagerStream::enqueue(Op op) {
  std::lock_guard lock(mutex_);
  ops_.push_back(std::move(op));
  enqueued_.fetch_add(1, std::memory_order_release);
  if (!scheduled_) schedule_locked();
}

void EagerStream::schedule_locked() {
  scheduled_ = true;
  keep_alive_ = shared_from_this();
  queues_->push(device_, WorkItem{&EagerStream::run_item, this, 0, id_ != kComputeStream});
}

void EagerStream::resume() {
  std::lock_guard lock(mutex_);
  keep_alive_ = shared_from_this();
  queues_->push(device_, WorkItem{&EagerStream::run_item, this, 0, id_ != kComputeStream});
}

void EagerStream::run_item(void* self, std::uint32_t) {
  static_cast<EagerStream*>(self)->step();
}

void EagerStream::step() {
  std::shared_ptr<EagerStream> self;
  {
    std::lock_guard lock(mutex_);
    self = std::move(keep_alive_);  // held by this frame while the stream runs
  }
  for (;;) {
    Op op;
    bool failed;
    {
      std::lock_guard lock(mutex_);
      if (ops_.empty()) {
        scheduled_ = false;
        break;
      }
      failed = error_ != nullptr;
      if (ops_.front().type == Op::Type::wait && !failed) {
        EventState& e = *ops_.front().event;
        if (e.failed.load(std::memory_order_acquire)) {
          std::lock_guard event_lock(e.mutex);
          error_ = std::make_exception_ptr(std::runtime_error(
              fmt::format("waited for event '{}', whose signalling task '{}' failed: {}", e.name,
                          e.failed_task, e.failure)));
          failed_task_ = fmt::format("wait for '{}'", e.name);
          failed = true;
        } else if (e.value.load(std::memory_order_acquire) < ops_.front().value) {
          // Park without holding a thread; the signal pushes this stream again. The event's
          // lock is taken without ours, as signal() takes them in the other order.
          auto event = ops_.front().event;
          const std::uint64_t v = ops_.front().value;
          mutex_.unlock();
          const bool parked = event->park(v, self);
          mutex_.lock();
          if (parked) return;
          continue;  // satisfied (or failed) meanwhile: look again
        }
      }
      op = std::move(ops_.front());
      ops_.pop_front();
    }
    if (op.type == Op::Type::work && !failed) {
      const bool trace = registry_.tracing();
      const std::uint64_t start = trace ? TickClock::ticks() : 0;
      try {
        InsideTaskScope inside;
        if (op.work) op.work();
      } catch (...) {
        std::lock_guard lock(mutex_);
        error_ = std::current_exception();
        failed_task_ = op.name;
      }
      if (trace) {
        try {
          registry_.record(*this, op, start, TickClock::ticks());
        } catch (...) {
          // A trace that cannot grow loses a span; the stream's work is not affected.
        }
      }
    } else if (op.type == Op::Type::signal) {
      // Events are failed without this stream's lock held: failing wakes other streams.
      std::string task, why;
      if (!failed) {
        try {
          op.event->signal(op.value);
        } catch (...) {
          std::lock_guard lock(mutex_);
          error_ = std::current_exception();
          failed_task_ = fmt::format("signal of '{}'", op.event->name);
          failed = true;
        }
      }
      if (failed) {
        {
          std::lock_guard lock(mutex_);
          task = failed_task_;
          why = describe(error_);
        }
        op.event->fail(task, why);
      }
    }
    done_.fetch_add(1, std::memory_order_acq_rel);
    queues_->wake_helpers();
  }
  queues_->wake_helpers();
}

bool EagerStream::idle() {
  return done_.load(std::memory_order_acquire) == enqueued_.load(std::memory_order_acquire);
}

void EagerStream::synchronize() {
  if (inside_task()) {
    throw std::logic_error(
        "Stream::synchronize() called from inside a task: a task must not block on other work; "
        "order it with events or graph edges instead");
  }
  const std::uint64_t target = enqueued_.load(std::memory_order_acquire);
  queues_->help_until([&] { return done_.load(std::memory_order_acquire) >= target; }, [] {},
                      100'000'000);
  std::exception_ptr error;
  std::string task;
  {
    std::lock_guard lock(mutex_);
    error = std::exchange(error_, nullptr);
    task = std::move(failed_task_);
  }
  if (error) {
    throw TaskError(task, kNoTask, error,
                    fmt::format("task '{}' on device {} failed: {}. Work queued after it on the "
                                "stream was dropped",
                                task, device_, describe(error)));
  }
}

// ---------------------------------------------------------------------------- EagerRegistry

EagerRegistry::EagerRegistry(std::shared_ptr<DeviceQueues> queues) : queues_(std::move(queues)) {}

std::shared_ptr<EagerStream> EagerRegistry::stream(DeviceId device, StreamId id) {
  std::lock_guard lock(mutex_);
  if (device >= queues_->size()) {
    throw std::out_of_range(fmt::format("device {} does not exist: the executor has {} devices",
                                        device, queues_->size()));
  }
  if (id >= names_.stream_count()) {
    throw std::out_of_range(fmt::format(
        "stream {} has no name: name extra streams with Executor::stream(device, name)", id));
  }
  auto& s = streams_[{device, id}];
  if (!s) s = std::make_shared<EagerStream>(device, id, queues_, *this);
  return s;
}

StreamId EagerRegistry::stream_id(std::string_view name) {
  std::lock_guard lock(mutex_);
  return names_.stream(name);
}

std::vector<std::shared_ptr<EagerStream>> EagerRegistry::streams() {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<EagerStream>> all;
  for (auto& [key, s] : streams_)
    all.push_back(s);
  return all;
}

void EagerRegistry::begin_trace() {
  std::lock_guard lock(mutex_);
  trace_table_ = std::make_shared<TaskTable>();
  for (std::size_t i = 2; i < names_.stream_count(); ++i) {
    trace_table_->stream(names_.stream_name(static_cast<StreamId>(i)));
  }
  trace_spans_.clear();
  trace_start_ = TickClock::ticks();
  tracing_.store(true, std::memory_order_release);
}

void EagerRegistry::record(const EagerStream& stream, const EagerStream::Op& op,
                           std::uint64_t start, std::uint64_t end) {
  std::lock_guard lock(mutex_);
  if (!trace_table_) return;
  // Streams named after the trace began.
  while (trace_table_->stream_count() < names_.stream_count()) {
    trace_table_->stream(names_.stream_name(static_cast<StreamId>(trace_table_->stream_count())));
  }
  TaskInfo info;
  info.device = stream.device();
  info.stream = stream.id();
  info.kind = op.kind;
  info.tags = op.tags;
  info.cost = op.cost;
  const TaskId t = trace_table_->add(info, op.name);
  trace_spans_.push_back(Span{t, static_cast<Nanos>(start), static_cast<Nanos>(end)});
}

Trace EagerRegistry::end_trace() {
  std::lock_guard lock(mutex_);
  tracing_.store(false, std::memory_order_release);
  if (!trace_table_) return {};
  const double scale = TickClock::ns_per_tick();
  for (Span& s : trace_spans_) {
    s.start = static_cast<Nanos>(
        static_cast<double>(static_cast<std::uint64_t>(s.start) - trace_start_) * scale);
    s.end = static_cast<Nanos>(
        static_cast<double>(static_cast<std::uint64_t>(s.end) - trace_start_) * scale);
  }
  Trace trace(std::move(trace_table_), std::move(trace_spans_), ClockKind::wall);
  trace_table_.reset();
  trace_spans_.clear();
  return trace;
}

}  // namespace detail

// ------------------------------------------------------------------------- Event and Stream

Event::Event(std::string name) : state_(std::make_shared<detail::EventState>()) {
  state_->name = name.empty() ? "event" : std::move(name);
}
std::string_view Event::name() const {
  return state_->name;
}
std::uint64_t Event::value() const {
  return state_->value.load(std::memory_order_acquire);
}
void Event::signal(std::uint64_t value) {
  state_->signal(value);
}
bool Event::failed() const {
  return state_->failed.load(std::memory_order_acquire);
}

DeviceId Stream::device() const {
  return impl_->device();
}
StreamId Stream::id() const {
  return impl_->id();
}

void Stream::enqueue(std::string_view name, std::function<void()> work, TaskKind kind,
                     TaskTags tags, CostHint cost) {
  detail::EagerStream::Op op{detail::EagerStream::Op::Type::work,
                             std::string(name),
                             std::move(work),
                             kind,
                             tags,
                             cost,
                             nullptr,
                             0};
  impl_->enqueue(std::move(op));
}

void Stream::signal(const Event& event, std::uint64_t value) {
  detail::EagerStream::Op op{
      detail::EagerStream::Op::Type::signal, {}, {}, TaskKind::host, {}, {}, event.state_, value};
  impl_->enqueue(std::move(op));
}

void Stream::wait(const Event& event, std::uint64_t value) {
  detail::EagerStream::Op op{
      detail::EagerStream::Op::Type::wait, {}, {}, TaskKind::host, {}, {}, event.state_, value};
  impl_->enqueue(std::move(op));
}

void Stream::synchronize() {
  impl_->synchronize();
}

}  // namespace weave::rt
