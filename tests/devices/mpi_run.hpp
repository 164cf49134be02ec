// Runs a program under `mpirun --oversubscribe -np P` on this host for the multi-process tests,
// capturing what every process prints. Open MPI refuses to run as root unless told otherwise:
// the tests tell it through the environment variables it reads, for their own runs only.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace weave::mpi_test {

struct RunResult {
  int status;       // the exit code, or -1 if the launcher did not exit normally
  std::string out;  // stdout and stderr of every process and of mpirun
};

inline RunResult run(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  RunResult r{-1, {}};
  if (!pipe) return r;
  std::array<char, 4096> buffer{};
  while (std::size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe))
    r.out.append(buffer.data(), n);
  const int status = pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Why the multi-process tests cannot run here, or "" when they can.
inline std::string missing_mpi() {
#ifndef WEAVE_MPIRUN
  return "weave was built without MPI (WEAVE_MPI=OFF): install libopenmpi-dev and openmpi-bin "
         "(tools/dev does) and configure again";
#else
  if (access(WEAVE_MPIRUN, X_OK) != 0)
    return fmt::format("mpirun ({}) is missing: install openmpi-bin (tools/dev does)",
                       WEAVE_MPIRUN);
  return "";
#endif
}

#define WEAVE_SKIP_WITHOUT_MPI()                              \
  do {                                                        \
    const std::string why = ::weave::mpi_test::missing_mpi(); \
    if (!why.empty()) GTEST_SKIP() << "skipped: " << why;     \
  } while (false)

// `program` under mpirun with `processes` processes; a launch that outlives `timeout_seconds`
// is ended (status 124), so a hang fails the test instead of stalling the suite.
inline RunResult mpirun(int processes, const std::string& program, int timeout_seconds = 300) {
#ifdef WEAVE_MPIRUN
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  // Containers often forbid the cross-process memory attach of the shared-memory transport.
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
  return run(fmt::format("timeout {} {} --oversubscribe -np {} {}", timeout_seconds, WEAVE_MPIRUN,
                         processes, program));
#else
  (void)processes;
  (void)timeout_seconds;
  return run(program);
#endif
}

}  // namespace weave::mpi_test
