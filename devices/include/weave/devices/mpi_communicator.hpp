// The multi-process backend: one run spread over the processes of an MPI job (`mpirun -np P`),
// on one host or several. The N devices are split into P equal blocks of consecutive ids,
// process p holding devices [p N/P, (p + 1) N/P) under their global ids, and each process builds
// and runs the graph of its own devices only.
//
// A collective whose members are all in this process is planned as the shared-memory backend
// plans it. One whose members sit in several processes meets its local members in shared
// memory; the first of them to run posts the process's part, one message per peer process with
// non-blocking MPI calls, and polls it a few microseconds: a collective whose peers are ready
// completes there, on the device's own thread. One that takes longer completes the local
// members' tasks later (deferred completion: no device's worker thread waits on MPI, and the
// executor's link model holds them as in one process), polled by whichever thread is idle: the
// devices' own threads between and instead of tasks, and the backend's progress thread. Reductions
// gather every member's data for a share of the elements and fold it in rank order, so a run over
// any number of processes gives bitwise what the same graph gives in one process. Every collective
// weave has is supported; a new one is a class in devices/src/mpi_collectives.cpp with its rounds
// of messages.
//
// Errors are weave's: MPI's error handler is replaced by error codes, a message whose size
// differs from what this process expects fails the collective naming the peer, and a peer
// process that ends (crashes, is killed) while others wait for it fails their runs within a
// fraction of a second, naming its rank, pid and host. A multi-process run cannot go on after a
// failed collective: report the error and call abort().
//
// Built only when weave is configured with MPI (the CMake option WEAVE_MPI, on when an MPI is
// found); otherwise available() is false and the constructor throws.
#pragma once

#include <memory>
#include <vector>

#include "weave/devices/communicator.hpp"
#include "weave/devices/topology.hpp"

namespace weave::devices {

class MpiCommunicator final : public Communicator {
 public:
  // Whether this build of weave has the MPI backend.
  static bool available();
  // Whether this process was started by an MPI launcher (mpirun, srun): its environment names
  // the job.
  static bool launched();

  // Joins the MPI job, initialising MPI the first time (it stays initialised until the program
  // exits; MPI_THREAD_SERIALIZED at least is needed), and spreads `devices` devices over its
  // processes. Throws std::invalid_argument when `devices` is not a positive multiple of the
  // number of processes, std::runtime_error when MPI cannot be used.
  explicit MpiCommunicator(int devices);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  MemberWork plan(const Collective& collective) override;
  bool holds(rt::DeviceId device) const override;
  // Agrees with every other process on the collectives planned since the last commit (a call
  // every process makes at the same point): checks that every group spanning processes has the
  // same number of collectives everywhere (std::runtime_error naming the group and the counts
  // otherwise) and numbers them alike, so their messages never mix.
  void commit() override;
  ProcessSet& processes() override;

  int devices() const;
  // This process's devices, ascending, and the process holding a device.
  std::vector<rt::DeviceId> held_devices() const;
  int process_of(rt::DeviceId device) const;
  // The cores (indices into topology.core_list()) this process lays its devices on
  // (process_cores of device_layout.hpp for its place among the processes on its host).
  std::vector<int> cores(const Topology& topology) const;
  // Ends every process of the job (MPI_Abort) with exit status `code`: after an error this
  // process has reported, since the others may be waiting for it.
  [[noreturn]] void abort(int code);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weave::devices
