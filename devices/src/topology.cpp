#include "weave/devices/topology.hpp"

#include <fmt/format.h>
#include <hwloc.h>

#include <stdexcept>

namespace weave::devices {

struct Topology::Impl {
  hwloc_topology_t topology = nullptr;
  bool synthetic = false;
  int packages = 0;
  int numa_nodes = 0;
  int pus = 0;
  std::vector<CoreInfo> cores;

  ~Impl() {
    if (topology) hwloc_topology_destroy(topology);
  }

  int numa_of(hwloc_const_cpuset_t cpuset) const {
    const int n = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE);
    for (int i = 0; i < n; ++i) {
      hwloc_obj_t node =
          hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
      if (node->cpuset && hwloc_bitmap_intersects(cpuset, node->cpuset)) return i;
    }
    return 0;
  }

  // Cores in hwloc's logical order (package, NUMA node, core). Some virtual machines report
  // no cores; their PUs then stand in for cores.
  void index() {
    packages = std::max(1, hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_PACKAGE));
    numa_nodes = std::max(1, hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE));
    pus = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_PU);
    hwloc_obj_type_t core_type =
        hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
    const int n = hwloc_get_nbobjs_by_type(topology, core_type);
    for (int i = 0; i < n; ++i) {
      hwloc_obj_t core = hwloc_get_obj_by_type(topology, core_type, static_cast<unsigned>(i));
      CoreInfo info;
      info.index = i;
      info.os_index = static_cast<int>(core->os_index);
      hwloc_obj_t package = hwloc_get_ancestor_obj_by_type(topology, HWLOC_OBJ_PACKAGE, core);
      info.package = package ? static_cast<int>(package->logical_index) : 0;
      info.numa_node = numa_of(core->cpuset);
      for (hwloc_obj_t pu = hwloc_get_next_obj_inside_cpuset_by_type(topology, core->cpuset,
                                                                     HWLOC_OBJ_PU, nullptr);
           pu; pu = hwloc_get_next_obj_inside_cpuset_by_type(topology, core->cpuset, HWLOC_OBJ_PU,
                                                             pu)) {
        info.pus.push_back(static_cast<int>(pu->os_index));
      }
      cores.push_back(std::move(info));
    }
    if (cores.empty()) throw std::runtime_error("hwloc found no cores or processing units");
  }
};

Topology::Topology(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Topology::~Topology() = default;
Topology::Topology(Topology&&) noexcept = default;
Topology& Topology::operator=(Topology&&) noexcept = default;

Topology Topology::detect() {
  auto impl = std::make_unique<Impl>();
  if (hwloc_topology_init(&impl->topology) != 0 || hwloc_topology_load(impl->topology) != 0) {
    throw std::runtime_error("hwloc could not read this machine's topology");
  }
  impl->index();
  return Topology(std::move(impl));
}

Topology Topology::synthetic(int packages, int numa_per_package, int cores_per_numa,
                             int pus_per_core) {
  if (packages < 1 || numa_per_package < 1 || cores_per_numa < 1 || pus_per_core < 1) {
    throw std::invalid_argument(fmt::format(
        "a synthetic topology needs at least one of each level (got {} packages x {} NUMA nodes "
        "x {} cores x {} PUs)",
        packages, numa_per_package, cores_per_numa, pus_per_core));
  }
  auto impl = std::make_unique<Impl>();
  impl->synthetic = true;
  const std::string description = fmt::format("pack:{} numa:{} core:{} pu:{}", packages,
                                              numa_per_package, cores_per_numa, pus_per_core);
  if (hwloc_topology_init(&impl->topology) != 0 ||
      hwloc_topology_set_synthetic(impl->topology, description.c_str()) != 0 ||
      hwloc_topology_load(impl->topology) != 0) {
    throw std::runtime_error(fmt::format("hwloc refused the synthetic topology '{}'", description));
  }
  impl->index();
  return Topology(std::move(impl));
}

int Topology::packages() const {
  return impl_->packages;
}
int Topology::numa_nodes() const {
  return impl_->numa_nodes;
}
int Topology::cores() const {
  return static_cast<int>(impl_->cores.size());
}
int Topology::pus() const {
  return impl_->pus;
}
const std::vector<CoreInfo>& Topology::core_list() const {
  return impl_->cores;
}
bool Topology::is_synthetic() const {
  return impl_->synthetic;
}
void* Topology::hwloc_handle() const {
  return impl_->topology;
}

std::string Topology::describe() const {
  std::string s = fmt::format("{}: {} package(s), {} NUMA node(s), {} core(s), {} PU(s)\n",
                              is_synthetic() ? "synthetic host" : "host", packages(), numa_nodes(),
                              cores(), pus());
  for (int node = 0; node < numa_nodes(); ++node) {
    std::vector<int> ids;
    for (const CoreInfo& c : impl_->cores) {
      if (c.numa_node == node) ids.push_back(c.os_index);
    }
    s += fmt::format("  NUMA node {}: cores {}\n", node, fmt::join(ids, " "));
  }
  return s;
}

}  // namespace weave::devices
