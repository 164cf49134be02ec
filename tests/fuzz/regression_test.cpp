// Every input with which a fuzz target found a crash, fed as the target feeds it: each is now
// refused with the clear error its reader documents. The inputs live in regressions/<target>;
// besides the named cases below, every file there is replayed, so an input added later is tested
// without new code.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint_input.hpp"
#include "indexed_dataset_input.hpp"
#include "schedule_csv_input.hpp"
#include "token_dataset_input.hpp"
#include "train_flags_input.hpp"

namespace weave::fuzz {
namespace {

const std::filesystem::path kRegressions = WEAVE_FUZZ_REGRESSIONS_DIR;

std::string read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A target with no recorded crash has no folder (git keeps no empty one).
std::vector<std::filesystem::path> inputs(const char* target) {
  std::vector<std::filesystem::path> out;
  if (!std::filesystem::is_directory(kRegressions / target)) return out;
  for (const auto& entry : std::filesystem::directory_iterator(kRegressions / target))
    if (entry.is_regular_file()) out.push_back(entry.path());
  return out;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

void read_text(const std::string& bytes) {
  ScratchFile file("regression-text");
  read_and_sample_text(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), file);
}

TEST(FuzzRegressions, CheckpointWhoseTensorEntryLacksItsSizeIsReportedDamaged) {
  TinyCheckpointStep step;
  try {
    step.load((kRegressions / "checkpoint/tensor_without_numel.ckpt").string());
    FAIL() << "a damaged header was loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "is damaged")) << e.what();
    EXPECT_TRUE(contains(e.what(), "numel")) << e.what();
  }
}

TEST(FuzzRegressions, ValidationFractionOutsideZeroToOneIsRefused) {
  try {
    read_text(read(kRegressions / "token_dataset/valid_fraction_out_of_range"));
    FAIL() << "a validation fraction of about -1e111 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(contains(e.what(), "validation fraction")) << e.what();
    EXPECT_TRUE(contains(e.what(), "at least 0 and less than 1")) << e.what();
  }
}

TEST(FuzzRegressions, ParallelSizesWhoseProductOverflowsAreRefused) {
  try {
    parse_train_flags(read(kRegressions / "train_flags/parallel_sizes_overflow_int"));
    FAIL() << "tp 100000 x cp 100000 x pp 3 was accepted";
  } catch (const graphs::ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "(100000 x 100000 x 3) exceeds 1048576 devices")) << e.what();
  }
}

TEST(FuzzRegressions, MicroBatchTimesDataParallelBeyondAnIntIsRefused) {
  try {
    parse_train_flags(
        read(kRegressions / "train_flags/micro_batch_times_data_parallel_overflows_int"));
    FAIL() << "a micro-batch of 2e9 samples on 4 replicas was accepted";
  } catch (const graphs::ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "--micro-batch-size 2000000000 x data-parallel size 4"))
        << e.what();
  }
}

TEST(FuzzRegressions, IndexedSequenceWhosePointerNearsInt64MaxIsRefusedAsOutsideTheBin) {
  IndexedFiles files;
  const std::string bytes = read(kRegressions / "indexed_dataset/pointer_near_int64_max");
  try {
    read_indexed_dataset(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(), files);
    FAIL() << "a sequence at byte 9223372036854775800 of a 16-byte .bin was read";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "from byte 9223372036854775800")) << e.what();
    EXPECT_TRUE(contains(e.what(), "truncated")) << e.what();
  }
}

// The indexed_dataset fuzz target's seeds (valid datasets) read, and every prefix of them and
// every one-byte change of its .idx is read or refused by rule, never a crash or a wrong read.
TEST(FuzzRegressions, IndexedDatasetSeedsReadAndTheirDamageIsRefused) {
  IndexedFiles files;
  const auto seeds = kRegressions.parent_path() / "corpus" / "indexed_dataset";
  int seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(seeds)) {
    SCOPED_TRACE(entry.path().string());
    std::string bytes = read(entry.path());
    const auto* data = reinterpret_cast<const std::uint8_t*>(bytes.data());
    EXPECT_NO_THROW(read_indexed_dataset(data, bytes.size(), files));
    for (std::size_t cut = 0; cut < bytes.size(); ++cut) {
      try {
        read_indexed_dataset(data, cut, files);
      } catch (const std::runtime_error&) {
      }
    }
    std::uint32_t idx_size = 0;
    std::memcpy(&idx_size, data, 4);
    for (std::size_t at = 4; at < 4 + std::size_t{idx_size}; ++at) {
      const char kept = bytes[at];
      bytes[at] = static_cast<char>(kept ^ 0x81);
      try {
        read_indexed_dataset(data, bytes.size(), files);
      } catch (const std::runtime_error&) {
      }
      bytes[at] = kept;
    }
    ++seen;
  }
  EXPECT_GE(seen, 3);
}

// The documented refusals only: anything else escapes and fails the test, an abort kills it.
TEST(FuzzRegressions, EveryRecordedInputIsRefusedOrReadWithoutHarm) {
  TinyCheckpointStep step;
  for (const auto& path : inputs("checkpoint")) {
    SCOPED_TRACE(path.string());
    EXPECT_THROW(step.load(path.string()), std::runtime_error);
  }
  for (const auto& path : inputs("token_dataset")) {
    SCOPED_TRACE(path.string());
    try {
      read_text(read(path));
    } catch (const std::runtime_error&) {
    } catch (const std::invalid_argument&) {
    }
  }
  IndexedFiles indexed;
  for (const auto& path : inputs("indexed_dataset")) {
    SCOPED_TRACE(path.string());
    const std::string bytes = read(path);
    try {
      read_indexed_dataset(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size(),
                           indexed);
    } catch (const std::runtime_error&) {
    }
  }
  for (const auto& path : inputs("train_flags")) {
    SCOPED_TRACE(path.string());
    try {
      parse_train_flags(read(path));
    } catch (const CLI::Error&) {
    } catch (const std::invalid_argument&) {
    }
  }
  for (const auto& path : inputs("schedule_csv")) {
    SCOPED_TRACE(path.string());
    try {
      read_check_and_rewrite_schedule(read(path));
    } catch (const graphs::ScheduleError&) {
    }
  }
}

}  // namespace
}  // namespace weave::fuzz
