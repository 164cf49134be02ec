// Eager mode internals: event state, streams that run enqueued work in order, and the
// registry that gives one stream object per (device, stream) and records eager traces.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device_queues.hpp"
#include "weave/runtime/task_table.hpp"
#include "weave/runtime/trace.hpp"

namespace weave::rt::detail {

class EagerStream;

struct EventState {
  std::string name;
  std::atomic<std::uint64_t> value{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::string failure;  // why it failed: the signalling stream's error
  std::string failed_task;
  std::vector<std::pair<std::uint64_t, std::shared_ptr<EagerStream>>> parked;
  std::vector<DeviceQueues*> host_waiters;

  // Sets the value; throws std::invalid_argument unless it grows.
  void signal(std::uint64_t v);
  void fail(const std::string& task, const std::string& why);
  // Parks the stream until value >= v; false (not parked) if that already holds or it failed.
  bool park(std::uint64_t v, std::shared_ptr<EagerStream> stream);
  void add_host_waiter(DeviceQueues* queues);
  void remove_host_waiter(DeviceQueues* queues);

 private:
  void wake(std::vector<std::shared_ptr<EagerStream>>& ready, std::vector<DeviceQueues*>& hosts);
};

class EagerRegistry;

class EagerStream : public std::enable_shared_from_this<EagerStream> {
 public:
  EagerStream(DeviceId device, StreamId id, std::shared_ptr<DeviceQueues> queues,
              EagerRegistry& registry);
  DeviceId device() const { return device_; }
  StreamId id() const { return id_; }

  struct Op {
    enum class Type : std::uint8_t { work, signal, wait } type;
    std::string name;
    std::function<void()> work;
    TaskKind kind = TaskKind::compute;
    TaskTags tags;
    CostHint cost;
    std::shared_ptr<EventState> event;
    std::uint64_t value = 0;
  };
  void enqueue(Op op);
  void synchronize();
  bool idle();
  // The event it waited for moved on: run again.
  void resume();

 private:
  static void run_item(void* self, std::uint32_t);
  void step();
  void schedule_locked();

  DeviceId device_;
  StreamId id_;
  std::shared_ptr<DeviceQueues> queues_;
  EagerRegistry& registry_;
  std::mutex mutex_;
  std::deque<Op> ops_;
  bool scheduled_ = false;  // queued, running or parked on an event
  std::shared_ptr<EagerStream> keep_alive_;
  std::atomic<std::uint64_t> enqueued_{0};
  std::atomic<std::uint64_t> done_{0};
  std::exception_ptr error_;
  std::string failed_task_;
};

class EagerRegistry {
 public:
  explicit EagerRegistry(std::shared_ptr<DeviceQueues> queues);
  std::shared_ptr<EagerStream> stream(DeviceId device, StreamId id);
  StreamId stream_id(std::string_view name);
  std::size_t stream_count();
  std::vector<std::shared_ptr<EagerStream>> streams();

  void begin_trace();
  Trace end_trace();
  bool tracing() const { return tracing_.load(std::memory_order_acquire); }
  void record(const EagerStream& stream, const EagerStream::Op& op, std::uint64_t start,
              std::uint64_t end);

 private:
  std::shared_ptr<DeviceQueues> queues_;
  std::mutex mutex_;
  TaskTable names_;  // stream names only
  std::map<std::pair<DeviceId, StreamId>, std::shared_ptr<EagerStream>> streams_;
  std::atomic<bool> tracing_{false};
  std::shared_ptr<TaskTable> trace_table_;
  std::vector<Span> trace_spans_;
  std::uint64_t trace_start_ = 0;
};

}  // namespace weave::rt::detail
