// A process killed (SIGKILL) while it writes a checkpoint leaves the checkpoint that was there
// intact and loadable: a child process saves in a loop, each save holding values that say which
// save it is; the parent kills it at a random moment of a save, then loads the file and finds one
// whole save, never a mix. Twenty kills in a row, and some of them must land inside a save (its
// partial file left behind), or the test would prove nothing.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>
#include <thread>

#include "tiny_model.hpp"
#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"

namespace weave::graphs {
namespace {

constexpr int kKills = 20;

// A model of a few MB, so that a save takes long enough to be interrupted.
ModelConfig model() {
  ModelConfig m = tiny(0);
  m.hidden_size = 128;
  m.ffn_hidden_size = 512;
  m.num_attention_heads = 4;
  return m;
}

// Every value the checkpoint holds (parameters and AdamW state) set to `value`.
void fill_state(TrainingStep& step, int ranks, float value) {
  for (int r = 0; r < ranks; ++r) {
    for (Parameter& p : step.shard(r).parameters())
      std::fill_n(p.value.data(), p.value.numel(), value);
    for (GradientBucket& b : step.shard(r).buckets()) {
      std::fill_n(b.exp_avg.data(), b.exp_avg.numel(), value);
      std::fill_n(b.exp_avg_sq.data(), b.exp_avg_sq.numel(), value);
    }
  }
}

// Whether every value the checkpoint holds equals `value`.
bool state_is(TrainingStep& step, int ranks, float value) {
  auto all = [value](const ops::Tensor& t) {
    return std::all_of(t.data(), t.data() + t.numel(), [value](float v) { return v == value; });
  };
  for (int r = 0; r < ranks; ++r) {
    for (Parameter& p : step.shard(r).parameters())
      if (!all(p.value)) return false;
    for (GradientBucket& b : step.shard(r).buckets())
      if (!all(b.exp_avg) || !all(b.exp_avg_sq)) return false;
  }
  return true;
}

// Saves k = 2, 3, ... with every value k, forever. Tells `parent` how long the first save took
// (nanoseconds, once it is complete), then sends a byte as each later save begins.
[[noreturn]] void save_forever(const std::string& path, const ModelConfig& m,
                               const ParallelPlan& plan, TrainingStep& step, int parent) {
  for (std::int64_t k = 2;; ++k) {
    fill_state(step, plan.devices(), static_cast<float>(k));
    if (k > 2) {
      const char begins = 1;
      if (::write(parent, &begins, 1) != 1) ::_exit(3);
    }
    const auto start = std::chrono::steady_clock::now();
    save_checkpoint(path, m, plan, step, {.iteration = k});
    if (k == 2) {
      const std::int64_t took = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now() - start)
                                    .count();
      if (::write(parent, &took, sizeof took) != sizeof took) ::_exit(3);
    }
  }
}

// Reads `size` bytes from `fd` within a minute; false if they did not come.
bool read_within_a_minute(int fd, void* out, std::size_t size) {
  pollfd ready{fd, POLLIN, 0};
  return ::poll(&ready, 1, 60'000) == 1 && ::read(fd, out, size) == static_cast<::ssize_t>(size);
}

TEST(CheckpointCrash, KillDuringSaveLeavesAWholeLoadableCheckpoint) {
  const ModelConfig m = model();
  ParallelPlan plan{.micro_batch_size = 1, .global_batch_size = 1};
  validate(m, plan);
  devices::DeviceSet devices(plan.devices(), {.pin = false});
  devices::SharedMemoryCommunicator comm;
  TrainingStep step(m, plan, {}, devices, comm);
  const std::string path =
      (std::filesystem::temp_directory_path() / fmt::format("weave-{}-crash.ckpt", ::getpid()))
          .string();
  const std::string partial = path + ".partial";

  std::mt19937 rng(7);
  int interrupted = 0;  // kills that landed inside a save
  for (int kill = 0; kill < kKills; ++kill) {
    std::filesystem::remove(partial);
    fill_state(step, plan.devices(), 1.0f);
    save_checkpoint(path, m, plan, step, {.iteration = 1});

    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(ready[0]);
      save_forever(path, m, plan, step, ready[1]);
    }
    ::close(ready[1]);
    // Once the child has saved once and begins another save, kill it: on odd rounds at a random
    // moment within as long as a save takes (its checksum and header, its writing, its rename,
    // or just after), on even rounds a random moment shortly after the partial file appears,
    // while the new checkpoint is being written.
    std::int64_t save_nanoseconds = 0;
    char begins = 0;
    const bool saving =
        read_within_a_minute(ready[0], &save_nanoseconds, sizeof save_nanoseconds) &&
        read_within_a_minute(ready[0], &begins, 1);
    if (saving && kill % 2 == 1) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(
          std::uniform_int_distribution<std::int64_t>(0, save_nanoseconds)(rng)));
    } else if (saving) {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(1);
      while (!std::filesystem::exists(partial) && std::chrono::steady_clock::now() < give_up)
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      std::this_thread::sleep_for(
          std::chrono::microseconds(std::uniform_int_distribution<int>(0, 300)(rng)));
    }
    ::kill(child, SIGKILL);
    ::close(ready[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(saving) << "the child never completed its first save or began its second";
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    if (std::filesystem::exists(partial)) ++interrupted;

    fill_state(step, plan.devices(), 0.0f);
    CheckpointState loaded;
    ASSERT_NO_THROW(loaded = load_checkpoint(path, m, plan, step)) << "kill " << kill;
    EXPECT_GE(loaded.iteration, 2) << "kill " << kill;  // the child's first save was complete
    EXPECT_TRUE(state_is(step, plan.devices(), static_cast<float>(loaded.iteration)))
        << "kill " << kill << ": the values are not all those of save " << loaded.iteration;
  }
  std::printf("%d of %d kills landed inside a save\n", interrupted, kKills);
  EXPECT_GT(interrupted, 0) << "no kill landed inside a save: the test did not test anything";
  std::filesystem::remove(path);
  std::filesystem::remove(partial);
}

}  // namespace
}  // namespace weave::graphs
