// The processes a run is spread over, as their host threads see them between steps: which
// process this is, and the few blocking exchanges a training loop makes (summing the step's
// results, gathering traces, agreeing on checkpoints). Every process makes the same calls in the
// same order. The base class is a run of one process: its exchanges return at once; a
// multi-process backend (MpiCommunicator) overrides them.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace weave::devices {

class ProcessSet {
 public:
  virtual ~ProcessSet() = default;

  // This process, from 0, and how many there are.
  virtual int index() const { return 0; }
  virtual int size() const { return 1; }

  // Element-wise sums over the processes, in place, added in process order so that every
  // process gets the same bits.
  virtual void sum(std::span<double> values) { (void)values; }
  // Every process's bytes, in process order, on process 0; an empty vector elsewhere.
  virtual std::vector<std::string> gather(const std::string& bytes) { return {bytes}; }
  // Process 0's bytes, on every process.
  virtual std::string broadcast(const std::string& bytes) { return bytes; }
  virtual void barrier() {}
  // This process's steady clock (std::chrono::steady_clock) minus process 0's, in nanoseconds,
  // as measured when the set was joined: a timestamp t taken here is t - clock_offset() on
  // process 0's clock.
  virtual std::int64_t clock_offset() const { return 0; }
};

}  // namespace weave::devices
