// The multi-process backend end to end, under `mpirun --oversubscribe -np P` on this host:
// every collective against its serial reference across 2 and 4 processes, sizes that differ
// between processes and a peer that ends, each failing with weave's message naming the peer;
// `weave train` across processes giving the one-process run's losses bitwise for every
// strategy, its merged trace, its checkpoints per process (ZeRO stage 3's equal to the
// one-process checkpoint), and its refusals (a device count
// the processes do not divide, a checkpoint of another process count, a killed process).
// Skipped, saying why, when weave has no MPI backend or mpirun is missing.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mpi_run.hpp"

namespace weave::mpi_test {
namespace {

#ifdef WEAVE_MPI_COLLECTIVES_CHECK
std::string collectives(const std::string& mode = "") {
  return fmt::format("{} {}", WEAVE_MPI_COLLECTIVES_CHECK, mode);
}
#endif

TEST(MpiCollectives, EveryCollectiveEqualsItsSerialReferenceBitwiseOverTwoProcesses) {
  WEAVE_SKIP_WITHOUT_MPI();
#ifdef WEAVE_MPI_COLLECTIVES_CHECK
  const RunResult r = mpirun(2, collectives());
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("over 2 processes, 0 failed"), std::string::npos) << r.out;
#endif
}

TEST(MpiCollectives, EveryCollectiveEqualsItsSerialReferenceBitwiseOverFourProcesses) {
  WEAVE_SKIP_WITHOUT_MPI();
#ifdef WEAVE_MPI_COLLECTIVES_CHECK
  const RunResult r = mpirun(4, collectives());
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("over 4 processes, 0 failed"), std::string::npos) << r.out;
#endif
}

TEST(MpiCollectives, SizesThatDifferBetweenProcessesFailTheRunNamingThePeer) {
  WEAVE_SKIP_WITHOUT_MPI();
#ifdef WEAVE_MPI_COLLECTIVES_CHECK
  const RunResult r = mpirun(2, collectives("--size-mismatch"));
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("process 0 failed as expected: task 'sum[0]'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sent 256 bytes where this process expected 512"), std::string::npos)
      << r.out;
#endif
}

TEST(MpiCollectives, APeerThatEndsStopsTheOthersNamingIt) {
  WEAVE_SKIP_WITHOUT_MPI();
#ifdef WEAVE_MPI_COLLECTIVES_CHECK
  const RunResult r = mpirun(3, collectives("--peer-ends"));
  EXPECT_NE(r.status, 0) << r.out;
  // Whichever survivor reports first (mpirun ends the job at the first failed process).
  const bool zero = r.out.find("process 0 stopped: task 'sum[0]'") != std::string::npos;
  const bool two = r.out.find("process 2 stopped: task 'sum[2]'") != std::string::npos;
  EXPECT_TRUE(zero || two) << r.out;
  // Found gone before the collective's messages were posted, or while it waited for them.
  EXPECT_NE(r.out.find("process 1 (pid"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("has ended"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("went on without process 1"), std::string::npos) << r.out;
#endif
}

// ------------------------------------------------------------------------------ weave train

std::filesystem::path scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   fmt::format("weave_mpi_test_{}", static_cast<long>(getpid()));
  std::filesystem::create_directories(dir);
  return dir / name;
}

const char* kTinyModel =
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 32 "
    "--micro-batch-size 2 --lr 1e-2 --lr-warmup-iters 2 --mock-data --train-iters 5";

// The losses a --log-json file holds, as written (JSON keeps a double's every bit).
std::vector<std::string> losses(const std::filesystem::path& log) {
  std::ifstream in(log);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].dump());
  }
  return out;
}

// `weave train` with `flags` in one process and over `processes` processes: the same losses,
// bit for bit, over 5 steps.
void expect_same_losses(const std::string& name, int processes, const std::string& flags) {
  const auto one = scratch(name + "_one.jsonl"), many = scratch(name + "_many.jsonl");
  const RunResult single = run(
      fmt::format("{} train {} {} --log-json {}", WEAVE_BINARY, kTinyModel, flags, one.string()));
  ASSERT_EQ(single.status, 0) << single.out;
  const RunResult spread = mpirun(
      processes,
      fmt::format("{} train {} {} --log-json {}", WEAVE_BINARY, kTinyModel, flags, many.string()));
  ASSERT_EQ(spread.status, 0) << spread.out;
  EXPECT_NE(spread.out.find(fmt::format("{} processes of", processes)), std::string::npos)
      << spread.out;
  const std::vector<std::string> expected = losses(one), got = losses(many);
  ASSERT_EQ(expected.size(), 5u) << single.out;
  EXPECT_EQ(got, expected) << spread.out;
}

TEST(MpiTrain, TensorAndSequenceParallelAcrossProcessesGiveTheOneProcessLossesBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  expect_same_losses("tp", 2, "--devices 2 --tensor-model-parallel-size 2 --sequence-parallel");
}

TEST(MpiTrain, ExpertParallelAcrossProcessesGivesTheOneProcessLossesBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  expect_same_losses("ep", 2,
                     "--devices 4 --num-experts 4 --expert-model-parallel-size 4 "
                     "--moe-aux-loss-coeff 0.01");
}

TEST(MpiTrain, ContextParallelAcrossProcessesGivesTheOneProcessLossesBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  expect_same_losses("cp", 2, "--devices 2 --context-parallel-size 2");
}

TEST(MpiTrain, DataParallelOverFourProcessesGivesTheOneProcessLossesBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  expect_same_losses("dp", 4, "--devices 4 --use-distributed-optimizer");
}

TEST(MpiTrain, PipelineStagesInTwoProcessesGiveTheOneProcessLossesBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  expect_same_losses("pp", 2, "--devices 2 --pipeline-model-parallel-size 2 --global-batch-size 8");
}

TEST(MpiTrain, AmpipeWithExpertsAcrossProcessesGivesTheOneProcessLossesBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  expect_same_losses("ampipe", 2,
                     "--devices 4 --tensor-model-parallel-size 2 --sequence-parallel "
                     "--num-experts 4 --expert-model-parallel-size 2 --ampipe-degree 2");
}

TEST(MpiTrain, SplitExpertsWithTheTpSpOverlapAcrossProcessesGiveTheOneProcessLossesBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  // One device a process: the tensor-parallel group, and so the experts' variable all-gathers
  // and reduce-scatters, span processes.
  expect_same_losses("split_experts", 4,
                     "--devices 4 --tensor-model-parallel-size 2 --sequence-parallel "
                     "--num-experts 4 --expert-model-parallel-size 2 --moe-model-type "
                     "deepspeed_moe --ampipe-degree 2 --ampipe-tp-sp-comm-overlap");
}

TEST(MpiTrain, Bf16StageThreeAcrossProcessesGivesTheOneProcessLossesBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  // The replicas' bf16 parameter shards gathered over MPI, two values to each element moved.
  expect_same_losses("zero3_bf16", 2, "--devices 2 --zero-stage 3 --bf16");
}

TEST(MpiTrain, ADeviceCountTheProcessesDoNotDivideIsRefused) {
  WEAVE_SKIP_WITHOUT_MPI();
  const RunResult r =
      mpirun(4, fmt::format("{} train {} --devices 6 --tensor-model-parallel-size 2", WEAVE_BINARY,
                            kTinyModel));
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("6 devices cannot be spread over 4 processes"), std::string::npos) << r.out;
}

TEST(MpiTrain, TheTraceMergesEveryProcessesDevicesOnOneClock) {
  WEAVE_SKIP_WITHOUT_MPI();
  const auto trace = scratch("merged.json");
  const RunResult r =
      mpirun(2, fmt::format("{} train {} --devices 2 --trace {} --trace-iteration 3", WEAVE_BINARY,
                            kTinyModel, trace.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto t = nlohmann::json::parse(std::ifstream(trace));
  std::vector<double> first_start(2, 1e300);
  for (const auto& e : t["traceEvents"])
    if (e.value("ph", "") == "X") {
      const int pid = e["pid"];
      ASSERT_TRUE(pid == 0 || pid == 1) << e.dump();
      first_start[static_cast<std::size_t>(pid)] =
          std::min(first_start[static_cast<std::size_t>(pid)], e["ts"].get<double>());
    }
  // Both processes' devices are there, their first tasks within the same second of one clock.
  EXPECT_LT(first_start[0], 1e300);
  EXPECT_LT(first_start[1], 1e300);
  EXPECT_LT(std::abs(first_start[0] - first_start[1]), 1e6);
}

TEST(MpiTrain, CheckpointsArePerProcessAndResumeOnlyWithTheirProcessCount) {
  WEAVE_SKIP_WITHOUT_MPI();
  const auto ckpt = scratch("model.ckpt");
  const std::string flags =
      fmt::format("{} --devices 4 --tensor-model-parallel-size 2", kTinyModel);
  RunResult r = mpirun(2, fmt::format("{} train {} --save {}", WEAVE_BINARY, flags, ckpt.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(std::filesystem::exists(ckpt.string() + ".part0-of-2.iter5"));
  EXPECT_TRUE(std::filesystem::exists(ckpt.string() + ".part1-of-2.iter5"));
  // Resumed by two processes: iterations 6 to 8 continue the run; by four or by one: refused.
  r = mpirun(
      2, fmt::format("{} train {} --load {} --train-iters 8", WEAVE_BINARY, flags, ckpt.string()));
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << r.out;
  r = mpirun(
      4, fmt::format("{} train {} --load {} --train-iters 8", WEAVE_BINARY, flags, ckpt.string()));
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("was saved by 2 processes and this run has 4 processes"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("mpirun -np 2"), std::string::npos) << r.out;
  r = run(fmt::format("{} train {} --load {} --train-iters 8", WEAVE_BINARY, flags, ckpt.string()));
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("was saved by 2 processes and this run has one process"), std::string::npos)
      << r.out;
}

// A checkpoint's tensor list (its header's "tensors") and its values' bytes, after the magic
// line, the header's size and the header.
struct CheckpointFile {
  nlohmann::json tensors;
  std::string values;
};

CheckpointFile read_checkpoint(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::string magic(19, '\0');
  std::uint64_t size = 0;
  in.read(magic.data(), static_cast<std::streamsize>(magic.size()));
  in.read(reinterpret_cast<char*>(&size), sizeof size);
  std::string header(size, '\0');
  in.read(header.data(), static_cast<std::streamsize>(size));
  CheckpointFile f{nlohmann::json::parse(header).at("tensors"), {}};
  f.values.assign(std::istreambuf_iterator<char>(in), {});
  return f;
}

// ZeRO stage 3 over two processes, a replica each: each process's part holds its rank's tensors
// as the one-process checkpoint does (the parameters whole, assembled from both processes'
// shards, and the rank's shard of the moments), so the parts put end to end are that checkpoint's
// tensors bit for bit; resumed over two processes, iterations 6 to 8 give the losses of the
// one-process run that went on, bit for bit.
TEST(MpiTrain, StageThreeCheckpointsAcrossProcessesEqualTheOneProcessOneAndResumeBitwise) {
  WEAVE_SKIP_WITHOUT_MPI();
  // The learning rate decays over 8 iterations in every run: the schedule of the run that went
  // on.
  const std::string flags =
      fmt::format("{} --devices 2 --zero-stage 3 --lr-decay-iters 8", kTinyModel);
  const auto one = scratch("zero3_one.ckpt"), many = scratch("zero3_many.ckpt");
  const auto straight = scratch("zero3_straight.jsonl"), resumed = scratch("zero3_resumed.jsonl");
  RunResult r = run(fmt::format("{} train {} --save {}", WEAVE_BINARY, flags, one.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  r = mpirun(2, fmt::format("{} train {} --save {}", WEAVE_BINARY, flags, many.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  const CheckpointFile whole = read_checkpoint(one);
  CheckpointFile parts;
  parts.tensors = nlohmann::json::array();
  for (int p = 0; p < 2; ++p) {
    const CheckpointFile part =
        read_checkpoint(many.string() + fmt::format(".part{}-of-2.iter5", p));
    for (const auto& t : part.tensors)
      parts.tensors.push_back(t);
    parts.values += part.values;
  }
  EXPECT_EQ(parts.tensors, whole.tensors);
  ASSERT_GT(whole.values.size(), 0u);
  EXPECT_TRUE(parts.values == whole.values) << "the parts' values differ from the one-process ones";
  r = mpirun(2, fmt::format("{} train {} --load {} --train-iters 8 --log-json {}", WEAVE_BINARY,
                            flags, many.string(), resumed.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  r = run(fmt::format("{} train {} --train-iters 8 --log-json {}", WEAVE_BINARY, flags,
                      straight.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  const std::vector<std::string> expected = losses(straight), got = losses(resumed);
  ASSERT_EQ(expected.size(), 8u) << r.out;
  EXPECT_EQ(got, std::vector<std::string>(expected.begin() + 5, expected.end()));
}

TEST(MpiTrain, AKilledProcessStopsTheOthersNamingIt) {
  WEAVE_SKIP_WITHOUT_MPI();
  // Process 1 is killed while training (a long run: it would take minutes); the other must
  // stop with weave's message naming it, well before the launch's time limit.
  const auto script = scratch("kill_second.sh");
  {
    std::ofstream s(script);
    s << "if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then (sleep 3; kill -9 $$) & fi\n"
      << "exec " << WEAVE_BINARY << " train " << kTinyModel
      << " --train-iters 100000 --devices 2 --tensor-model-parallel-size 2\n";
  }
  const RunResult r = mpirun(2, "sh " + script.string(), 120);
  EXPECT_NE(r.status, 0) << r.out;
  EXPECT_NE(r.status, 124) << "the survivor did not stop: " << r.out;
  EXPECT_NE(r.out.find("weave: error: process 0:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("process 1 (pid"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("has ended"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace weave::mpi_test
