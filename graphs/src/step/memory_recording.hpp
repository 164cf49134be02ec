// What a step's build notes for its memory over the step (StepBuildOptions::record_memory): which
// activation set an allocation belongs to, and the first task built using each set, so that a set
// laid out before any task counts from the first task that takes it, as a caching allocator
// would first be asked for it. Active on the building thread only, while TrainingStep records.
#pragma once

#include <cstddef>
#include <map>
#include <utility>

namespace weave::graphs {

struct MemoryRecording {
  int rank = -1, set = -1;  // the activation set being allocated, or -1
  // (rank, set) -> the number of tasks built before the first task using the set.
  std::map<std::pair<int, int>, std::size_t> first_use;
};

// The recording of the step being built on this thread, or null.
MemoryRecording*& active_memory_recording();

}  // namespace weave::graphs
