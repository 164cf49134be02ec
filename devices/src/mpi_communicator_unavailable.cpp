// MpiCommunicator in a build without MPI (WEAVE_MPI off): it says so, and refuses to be built.
#include <cstdlib>
#include <stdexcept>

#include "weave/devices/mpi_communicator.hpp"

namespace weave::devices {

namespace {
[[noreturn]] void unavailable() {
  throw std::runtime_error(
      "this weave was built without MPI: install Open MPI (libopenmpi-dev, openmpi-bin; tools/dev "
      "does) and configure again with -DWEAVE_MPI=ON");
}
}  // namespace

struct MpiCommunicator::Impl {};

bool MpiCommunicator::available() {
  return false;
}
bool MpiCommunicator::launched() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_SIZE");
}
MpiCommunicator::MpiCommunicator(int) {
  unavailable();
}
MpiCommunicator::~MpiCommunicator() = default;
MemberWork MpiCommunicator::plan(const Collective&) {
  unavailable();
}
bool MpiCommunicator::holds(rt::DeviceId) const {
  unavailable();
}
void MpiCommunicator::commit() {
  unavailable();
}
ProcessSet& MpiCommunicator::processes() {
  unavailable();
}
int MpiCommunicator::devices() const {
  unavailable();
}
std::vector<rt::DeviceId> MpiCommunicator::held_devices() const {
  unavailable();
}
int MpiCommunicator::process_of(rt::DeviceId) const {
  unavailable();
}
std::vector<int> MpiCommunicator::cores(const Topology&) const {
  unavailable();
}
void MpiCommunicator::abort(int code) {
  std::_Exit(code);
}

}  // namespace weave::devices
