// The processes of an MPI job as a ProcessSet: the host threads' exchanges between steps, run
// as operations of the progress thread (so a peer that ends is noticed there too) on a
// communicator of their own, numbered by the order every process makes them in.
#pragma once

#include <future>
#include <string>
#include <vector>

#include "weave/devices/process_set.hpp"

namespace weave::devices::detail {

class MpiJob;
struct MpiRound;

class MpiProcessSet final : public ProcessSet {
 public:
  explicit MpiProcessSet(MpiJob& job) : job_(job) {}

  int index() const override;
  int size() const override;
  void sum(std::span<double> values) override;
  std::vector<std::string> gather(const std::string& bytes) override;
  std::string broadcast(const std::string& bytes) override;
  void barrier() override;
  std::int64_t clock_offset() const override;

  // Every process's bytes, in process order, on every process.
  std::vector<std::string> all_gather(const std::string& bytes);

 private:
  // Runs rounds of messages made by `rounds` (called in turn on the progress thread) and waits.
  void run(const std::string& what, std::vector<std::function<MpiRound()>> rounds);

  MpiJob& job_;
  std::int64_t sequence_ = 0;
};

}  // namespace weave::devices::detail
