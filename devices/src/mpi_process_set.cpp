#include "mpi_process_set.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <functional>

#include "mpi_job.hpp"
#include "mpi_progress.hpp"

namespace weave::devices::detail {

namespace {

class HostExchange final : public MpiOperation {
 public:
  HostExchange(std::string what, std::vector<std::function<MpiRound()>> rounds)
      : what_(std::move(what)), rounds_(std::move(rounds)) {}
  std::optional<MpiRound> next() override {
    if (next_ == rounds_.size()) return std::nullopt;
    return rounds_[next_++]();
  }
  void finished(std::exception_ptr error) override {
    if (error)
      done_.set_exception(error);
    else
      done_.set_value();
  }
  std::string describe() const override { return what_; }
  std::future<void> done() { return done_.get_future(); }

 private:
  std::string what_;
  std::vector<std::function<MpiRound()>> rounds_;
  std::size_t next_ = 0;
  std::promise<void> done_;
};

}  // namespace

int MpiProcessSet::index() const {
  return job_.rank();
}
int MpiProcessSet::size() const {
  return job_.size();
}
std::int64_t MpiProcessSet::clock_offset() const {
  return job_.clock_offset();
}

void MpiProcessSet::run(const std::string& what, std::vector<std::function<MpiRound()>> rounds) {
  auto op = std::make_shared<HostExchange>(what, std::move(rounds));
  op->comm = job_.host();
  op->id = sequence_++;
  std::future<void> done = op->done();
  MpiProgress& progress = job_.progress();
  progress.submit(op);
  // Poll here a moment (the peers are usually at the same point); the engine's thread drives
  // what is left, watching for peers that end.
  progress.drive(*op, std::chrono::microseconds(100));
  done.get();
}

std::vector<std::string> MpiProcessSet::all_gather(const std::string& bytes) {
  const int n = size(), me = index();
  std::vector<std::uint64_t> sizes(static_cast<std::size_t>(n), 0);
  sizes[static_cast<std::size_t>(me)] = bytes.size();
  std::vector<std::string> out(static_cast<std::size_t>(n));
  out[static_cast<std::size_t>(me)] = bytes;
  run("the processes' exchange of results between steps",
      {[&] {
         MpiRound round;
         for (int p = 0; p < n; ++p) {
           if (p == me) continue;
           round.sends.push_back({p, &sizes[static_cast<std::size_t>(me)], sizeof(std::uint64_t)});
           round.receives.push_back(
               {p, &sizes[static_cast<std::size_t>(p)], sizeof(std::uint64_t)});
         }
         return round;
       },
       [&] {
         MpiRound round;
         for (int p = 0; p < n; ++p) {
           if (p == me) continue;
           out[static_cast<std::size_t>(p)].resize(sizes[static_cast<std::size_t>(p)]);
           round.sends.push_back({p, out[static_cast<std::size_t>(me)].data(),
                                  out[static_cast<std::size_t>(me)].size()});
           round.receives.push_back({p, out[static_cast<std::size_t>(p)].data(),
                                     out[static_cast<std::size_t>(p)].size()});
         }
         return round;
       }});
  return out;
}

void MpiProcessSet::sum(std::span<double> values) {
  std::string mine(values.size() * sizeof(double), '\0');
  std::memcpy(mine.data(), values.data(), mine.size());
  const std::vector<std::string> all = all_gather(mine);
  for (std::size_t i = 0; i < values.size(); ++i) {
    double total = 0;
    for (const std::string& from : all) {
      if (from.size() != mine.size())
        throw std::runtime_error(fmt::format(
            "the processes summed {} and {} values: every process must sum the same number",
            from.size() / sizeof(double), values.size()));
      double v;
      std::memcpy(&v, from.data() + i * sizeof(double), sizeof v);
      total += v;
    }
    values[i] = total;
  }
}

std::vector<std::string> MpiProcessSet::gather(const std::string& bytes) {
  const int n = size(), me = index();
  std::uint64_t mine = bytes.size();
  std::vector<std::uint64_t> sizes(static_cast<std::size_t>(n), 0);
  std::vector<std::string> out;
  if (me == 0) {
    out.resize(static_cast<std::size_t>(n));
    out[0] = bytes;
  }
  run("the gathering of the processes' results on process 0",
      {[&] {
         MpiRound round;
         if (me != 0)
           round.sends.push_back({0, &mine, sizeof mine});
         else
           for (int p = 1; p < n; ++p)
             round.receives.push_back(
                 {p, &sizes[static_cast<std::size_t>(p)], sizeof(std::uint64_t)});
         return round;
       },
       [&] {
         MpiRound round;
         if (me != 0) {
           round.sends.push_back({0, const_cast<char*>(bytes.data()), bytes.size()});
         } else {
           for (int p = 1; p < n; ++p) {
             out[static_cast<std::size_t>(p)].resize(sizes[static_cast<std::size_t>(p)]);
             round.receives.push_back({p, out[static_cast<std::size_t>(p)].data(),
                                       out[static_cast<std::size_t>(p)].size()});
           }
         }
         return round;
       }});
  return out;
}

std::string MpiProcessSet::broadcast(const std::string& bytes) {
  const int n = size(), me = index();
  std::uint64_t length = bytes.size();
  std::string out = me == 0 ? bytes : std::string();
  run("process 0's broadcast to the others",
      {[&] {
         MpiRound round;
         if (me == 0)
           for (int p = 1; p < n; ++p)
             round.sends.push_back({p, &length, sizeof length});
         else
           round.receives.push_back({0, &length, sizeof length});
         return round;
       },
       [&] {
         MpiRound round;
         if (me == 0) {
           for (int p = 1; p < n; ++p)
             round.sends.push_back({p, out.data(), out.size()});
         } else {
           out.resize(length);
           round.receives.push_back({0, out.data(), out.size()});
         }
         return round;
       }});
  return out;
}

void MpiProcessSet::barrier() {
  const int n = size(), me = index();
  run("a barrier of the processes", {[&] {
        MpiRound round;
        for (int p = 0; p < n; ++p) {
          if (p == me) continue;
          round.sends.push_back({p, nullptr, 0});
          round.receives.push_back({p, nullptr, 0});
        }
        return round;
      }});
}

}  // namespace weave::devices::detail
