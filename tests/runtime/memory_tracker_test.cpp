// Current and peak bytes per device and category.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "weave/runtime/memory_tracker.hpp"

namespace weave::rt {
namespace {

using Cat = MemoryCategory;

TEST(MemoryTracker, TracksCurrentAndPeakPerCategoryAndDevice) {
  MemoryTracker m(2);
  m.allocated(0, Cat::parameters, 100);
  m.allocated(0, Cat::activations, 50);
  m.allocated(1, Cat::gradients, 7);
  m.released(0, Cat::activations, 50);
  m.allocated(0, Cat::activations, 30);
  EXPECT_EQ(m.current(0, Cat::parameters), 100);
  EXPECT_EQ(m.current(0, Cat::activations), 30);
  EXPECT_EQ(m.peak(0, Cat::activations), 50);
  EXPECT_EQ(m.current_total(0), 130);
  EXPECT_EQ(m.peak_total(0), 150);  // the highest sum held at once
  EXPECT_EQ(m.current_total(1), 7);
  EXPECT_EQ(m.current(1, Cat::parameters), 0);
  m.reset_peaks();
  EXPECT_EQ(m.peak(0, Cat::activations), 30);
  EXPECT_EQ(m.peak_total(0), 130);
}

TEST(MemoryTracker, OverReleaseIsRefusedAndChangesNothing) {
  MemoryTracker m(1);
  m.allocated(0, Cat::comm_buffers, 10);
  try {
    m.released(0, Cat::comm_buffers, 11);
    FAIL();
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("comm_buffers"), std::string::npos);
  }
  EXPECT_EQ(m.current(0, Cat::comm_buffers), 10);
  EXPECT_EQ(m.current_total(0), 10);
  EXPECT_THROW(m.allocated(1, Cat::workspace, 1), std::out_of_range);
  EXPECT_THROW(m.current(3, Cat::workspace), std::out_of_range);
}

TEST(MemoryTracker, ConcurrentUpdatesKeepExactCounts) {
  MemoryTracker m(1);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&m] {
      for (int i = 0; i < 20000; ++i) {
        m.allocated(0, Cat::optimizer_state, 8);
        if (i % 2) m.released(0, Cat::optimizer_state, 8);
      }
    });
  }
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(m.current(0, Cat::optimizer_state), 4 * 10000 * 8);
  EXPECT_GE(m.peak(0, Cat::optimizer_state), m.current(0, Cat::optimizer_state));
  EXPECT_EQ(to_string(Cat::optimizer_state), "optimizer_state");
}

}  // namespace
}  // namespace weave::rt
