#include "weave/devices/mpi_communicator.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>

#include "mpi_collectives.hpp"
#include "mpi_job.hpp"
#include "mpi_process_set.hpp"
#include "weave/devices/device_layout.hpp"
#include "weave/devices/shared_memory_communicator.hpp"

namespace weave::devices {

namespace {

// Groups are told apart by name and devices, as the matcher tells them apart.
std::string group_key(const ProcessGroup& group) {
  return fmt::format("{}({})", group.name(), fmt::join(group.devices(), ","));
}

}  // namespace

struct MpiCommunicator::Impl {
  explicit Impl(int n) : job(detail::MpiJob::join()), processes(*job), devices(n) {}

  std::shared_ptr<detail::MpiJob> job;
  detail::MpiProcessSet processes;
  SharedMemoryCommunicator local;
  int devices = 0, per_process = 0;
  // Collectives over each group spanning processes: planned so far, and up to the last commit.
  struct Counts {
    std::uint64_t planned = 0, committed = 0;
  };
  std::map<std::string, Counts> groups;
  struct Uncommitted {
    std::string group;
    std::uint64_t sequence;
    std::shared_ptr<detail::SpanningCollective> collective;
  };
  std::vector<Uncommitted> uncommitted;
  std::int64_t next_id = 0;
};

bool MpiCommunicator::available() {
  return true;
}

bool MpiCommunicator::launched() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_SIZE");
}

MpiCommunicator::MpiCommunicator(int devices) : impl_(std::make_unique<Impl>(devices)) {
  const int p = impl_->job->size();
  if (devices < 1 || devices % p != 0)
    throw std::invalid_argument(fmt::format(
        "{} devices cannot be spread over {} processes: each process holds the same number of "
        "devices, so --devices must be a multiple of the process count (mpirun -np {}); use {} "
        "or {} devices, or another process count",
        devices, p, p, std::max(p, devices / p * p), (devices / p + 1) * p));
  impl_->per_process = devices / p;
}

MpiCommunicator::~MpiCommunicator() = default;

int MpiCommunicator::devices() const {
  return impl_->devices;
}

int MpiCommunicator::process_of(rt::DeviceId device) const {
  return static_cast<int>(device) / impl_->per_process;
}

bool MpiCommunicator::holds(rt::DeviceId device) const {
  return device < static_cast<rt::DeviceId>(impl_->devices) &&
         process_of(device) == impl_->job->rank();
}

std::vector<rt::DeviceId> MpiCommunicator::held_devices() const {
  std::vector<rt::DeviceId> ids;
  const int first = impl_->job->rank() * impl_->per_process;
  for (int d = first; d < first + impl_->per_process; ++d)
    ids.push_back(static_cast<rt::DeviceId>(d));
  return ids;
}

std::vector<int> MpiCommunicator::cores(const Topology& topology) const {
  return process_cores(topology, impl_->job->local_index(), impl_->job->local_count());
}

ProcessSet& MpiCommunicator::processes() {
  return impl_->processes;
}

MemberWork MpiCommunicator::plan(const Collective& c) {
  std::vector<int> process_of_member;
  bool spans = false;
  for (int r = 0; r < c.group.size(); ++r) {
    const rt::DeviceId d = c.group.device(r);
    if (d >= static_cast<rt::DeviceId>(impl_->devices))
      throw std::invalid_argument(
          fmt::format("{} over group '{}': rank {} is device {}, outside the job's {} devices",
                      to_string(c.call.op), c.group.name(), r, d, impl_->devices));
    process_of_member.push_back(process_of(d));
    spans |= process_of_member.back() != impl_->job->rank();
  }
  if (!spans) return impl_->local.plan(c);
  auto collective = detail::SpanningCollective::make(c, *impl_->job, std::move(process_of_member));
  const std::string key = group_key(c.group);
  const std::uint64_t sequence = impl_->groups[key].planned++;
  impl_->uncommitted.push_back({key, sequence, collective});
  return collective->work();
}

void MpiCommunicator::commit() {
  Impl& m = *impl_;
  std::string mine;
  for (const auto& [key, counts] : m.groups)
    if (counts.planned > counts.committed)
      mine += fmt::format("{}\t{}\n", key, counts.planned - counts.committed);
  const std::vector<std::string> all = m.processes.all_gather(mine);
  // Every process's new collectives per group; they must agree.
  std::map<std::string, std::vector<std::pair<int, std::uint64_t>>> reported;
  for (std::size_t p = 0; p < all.size(); ++p) {
    std::istringstream lines(all[p]);
    std::string line;
    while (std::getline(lines, line)) {
      const auto tab = line.rfind('\t');
      reported[line.substr(0, tab)].push_back(
          {static_cast<int>(p), std::stoull(line.substr(tab + 1))});
    }
  }
  std::map<std::string, std::int64_t> offset;
  std::int64_t total = 0;
  for (const auto& [key, counts] : reported) {
    for (const auto& [process, count] : counts)
      if (count != counts.front().second)
        throw std::runtime_error(fmt::format(
            "the processes issued different collectives over group {}: process {} issued {} "
            "and process {} issued {} since the last commit; every process must build the same "
            "step (the same configuration on every process) and commit at the same point",
            key, counts.front().first, counts.front().second, process, count));
    offset[key] = total;
    total += static_cast<std::int64_t>(counts.front().second);
  }
  for (const Impl::Uncommitted& u : m.uncommitted)
    u.collective->commit(m.next_id + offset.at(u.group) +
                         static_cast<std::int64_t>(u.sequence - m.groups[u.group].committed));
  for (auto& [key, counts] : m.groups)
    counts.committed = counts.planned;
  m.uncommitted.clear();
  m.next_id += total;
}

void MpiCommunicator::abort(int code) {
  impl_->job->mark_failed();
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace weave::devices
