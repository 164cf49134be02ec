// Polling by the executor's idle threads, for a transport that moves data only while some
// thread polls it (MPI over shared memory or a network).
//
// A transfer that completes on a thread of its own must then wake the device's thread to run
// what follows, and waking a sleeping thread costs tens of microseconds on a busy host: more
// than a small collective. Instead, a thread of the executor that has nothing to run (a drainer
// lingering for work, the thread helping a run) polls the transport while transfers are in
// flight, so the device's own thread completes its transfer and runs the next task at once.
#pragma once

namespace weave::rt {

class IdlePoll {
 public:
  virtual ~IdlePoll() = default;
  // Whether transfers are in flight. While true, a thread with nothing to run keeps polling
  // for a while (about what waking a thread costs) before it leaves or sleeps. Called often:
  // a load of an atomic, no more.
  virtual bool busy() const noexcept = 0;
  // Moves the transfers in flight on, and completes those that are over. Never blocks (a poll
  // that another thread is making is skipped) and never throws.
  virtual void poll() noexcept = 0;
};

// Installs `poll` for every executor of this process, or removes it (nullptr). One at a time:
// installing another replaces it. Removing waits until no thread is still inside the one
// removed, so that it may be destroyed right after.
void set_idle_poll(IdlePoll* poll);

}  // namespace weave::rt
