#include "step/comm_streams.hpp"

#include <algorithm>

namespace weave::graphs {

std::vector<std::pair<std::string, std::vector<rt::StreamId>>> streams_by_group(
    const rt::TaskTable& tasks) {
  std::vector<std::pair<std::string, std::vector<rt::StreamId>>> groups;
  for (rt::StreamId s = 0; s < tasks.stream_count(); ++s) {
    if (s == rt::kComputeStream) continue;
    const CommGroup kind = comm_group_of(tasks.stream_kind(s));
    const std::string group(kind != CommGroup::unclassified ? to_string(kind)
                                                            : tasks.stream_name(s));
    auto at =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == group; });
    if (at == groups.end()) at = groups.insert(groups.end(), {group, {}});
    at->second.push_back(s);
  }
  return groups;
}

}  // namespace weave::graphs
