// A checkpoint save that fails says why and leaves nothing behind: what the path held before
// stays, and no partial file remains beside it.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "weave/devices/device_set.hpp"
#include "weave/devices/shared_memory_communicator.hpp"
#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/training_step.hpp"

namespace {

namespace fs = std::filesystem;
using namespace weave;

struct TinyStep {
  graphs::ModelConfig model{.num_layers = 1,
                            .hidden_size = 8,
                            .num_attention_heads = 2,
                            .ffn_hidden_size = 16,
                            .seq_length = 4};
  graphs::ParallelPlan plan = [this] {
    graphs::ParallelPlan p{.micro_batch_size = 1, .global_batch_size = 1};
    graphs::validate(model, p);
    return p;
  }();
  devices::DeviceSet devices{1, {.pin = false}};
  devices::SharedMemoryCommunicator comm;
  graphs::TrainingStep step{model, plan, {}, devices, comm};
};

fs::path scratch_folder() {
  const fs::path dir = fs::temp_directory_path() / fmt::format("weave-save-{}", ::getpid());
  fs::create_directories(dir);
  return dir;
}

TEST(CheckpointSave, OntoAFolderFailsNamingItAndLeavesNoPartialFile) {
  TinyStep t;
  const fs::path dir = scratch_folder();
  const fs::path target = dir / "m.ckpt";
  fs::create_directories(target / "inside");
  try {
    graphs::save_checkpoint(target.string(), t.model, t.plan, t.step, {});
    ADD_FAILURE() << "a checkpoint was saved onto a folder";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is a folder"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(target.string() + ".partial"));
  EXPECT_TRUE(fs::is_directory(target / "inside"));  // what was there is untouched
  fs::remove_all(dir);
}

TEST(CheckpointSave, AFailedWriteLeavesTheOldCheckpointWhole) {
  TinyStep t;
  const fs::path dir = scratch_folder();
  const fs::path target = dir / "m.ckpt";
  graphs::save_checkpoint(target.string(), t.model, t.plan, t.step, {.iteration = 1});
  const auto before = fs::file_size(target);
  // A folder in the partial file's name makes the write fail, as a full disk would.
  fs::create_directories(target.string() + ".partial/x");
  EXPECT_THROW(graphs::save_checkpoint(target.string(), t.model, t.plan, t.step, {.iteration = 2}),
               std::runtime_error);
  EXPECT_EQ(fs::file_size(target), before);
  EXPECT_EQ(graphs::load_checkpoint(target.string(), t.model, t.plan, t.step).iteration, 1);
  fs::remove_all(dir);
}

}  // namespace
