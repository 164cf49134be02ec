// Test fixture pieces: device arenas without the devices layer, and a cap on TBB threads.
#pragma once

#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <memory>
#include <vector>

namespace weave::rt::testing {

// `devices` arenas of `concurrency` slots each, all open to worker threads.
class Arenas {
 public:
  Arenas(int devices, int concurrency = 1) {
    for (int i = 0; i < devices; ++i) {
      arenas_.push_back(std::make_unique<tbb::task_arena>(concurrency, 0));
    }
  }
  std::vector<tbb::task_arena*> pointers() const {
    std::vector<tbb::task_arena*> p;
    for (auto& a : arenas_)
      p.push_back(a.get());
    return p;
  }

 private:
  std::vector<std::unique_ptr<tbb::task_arena>> arenas_;
};

// At most `threads` threads run TBB work, the calling thread included: 1 means no worker
// thread at all, so the thread that calls run() must do everything itself.
inline tbb::global_control limit_threads(int threads) {
  return tbb::global_control(tbb::global_control::max_allowed_parallelism,
                             static_cast<std::size_t>(threads));
}

}  // namespace weave::rt::testing
