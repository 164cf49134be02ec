// The host's processors as hwloc sees them: packages, NUMA nodes, cores and PUs.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace weave::devices {

struct CoreInfo {
  int index = 0;         // position in core order (hwloc's logical order: package, NUMA, core)
  int os_index = 0;      // the OS's number for the core
  int package = 0;       // logical package index
  int numa_node = 0;     // logical NUMA node index
  std::vector<int> pus;  // OS indices of its hardware threads
};

class Topology {
 public:
  // The machine this process runs on.
  static Topology detect();
  // A made-up machine (hwloc synthetic topology), for tests and for planning larger hosts.
  static Topology synthetic(int packages, int numa_per_package, int cores_per_numa,
                            int pus_per_core = 1);
  ~Topology();
  Topology(Topology&&) noexcept;
  Topology& operator=(Topology&&) noexcept;

  int packages() const;
  int numa_nodes() const;
  int cores() const;
  int pus() const;
  const std::vector<CoreInfo>& core_list() const;
  // True for a synthetic topology: its cpusets are not this host's, so nothing is pinned.
  bool is_synthetic() const;
  // Several lines: counts, then one line per NUMA node with its cores.
  std::string describe() const;

  // The hwloc topology (hwloc_topology_t), for binding threads and memory.
  void* hwloc_handle() const;

 private:
  struct Impl;
  explicit Topology(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weave::devices
