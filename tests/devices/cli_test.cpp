// The `weave` program end to end: exit codes, JSON output, error messages, written files.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

struct Result {
  int status;
  std::string out;  // stdout and stderr
};

Result weave(const std::string& args) {
  const std::string command = fmt::format("{} {} 2>&1", WEAVE_BINARY, args);
  FILE* pipe = popen(command.c_str(), "r");
  Result r{-1, {}};
  if (!pipe) return r;
  std::array<char, 4096> buffer{};
  while (std::size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe))
    r.out.append(buffer.data(), n);
  const int status = pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(Cli, TopoJsonDescribesEveryDevice) {
  const Result r = weave("topo --devices 8 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["devices"].size(), 8u);
  int cores = j["cores"];
  for (const auto& d : j["devices"]) {
    EXPECT_EQ(d["concurrency"], cores >= 8 ? static_cast<int>(d["cores"].size()) : 1);
    EXPECT_FALSE(d["cores"].empty());
  }
}

TEST(Cli, TopoOnASyntheticHost) {
  const Result r = weave("topo --synthetic 2,2,8 --devices 4 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["numa_nodes"], 4);
  for (int d = 0; d < 4; ++d)
    EXPECT_EQ(j["devices"][d]["numa_node"], d);
}

TEST(Cli, BadInputIsRefusedWithTheRuleAndTheValue) {
  Result r = weave("topo --devices 0");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("at least 1 (got '0')"), std::string::npos) << r.out;
  r = weave("simulate --link nvlink9 --timing model");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("unknown link preset 'nvlink9'"), std::string::npos) << r.out;
  r = weave("topo --synthetic 2,2");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--synthetic takes"), std::string::npos) << r.out;
  r = weave("frobnicate");
  EXPECT_NE(r.status, 0);
}

TEST(Cli, SimulateWritesTracesAndAGraph) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("weave-cli-{}", ::getpid());
  std::filesystem::create_directories(dir);
  const Result r = weave(fmt::format(
      "simulate --devices 4 --layers 1 --chunks 2 --flops 1e5 --bytes 65536 --link ampipe-20gbps "
      "--timing both --iterations 1 --trace {}/t.json --dump-graph {}/g.dot --json",
      dir.string(), dir.string()));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto report = nlohmann::json::parse(r.out);
  ASSERT_EQ(report["clocks"].size(), 2u);
  EXPECT_EQ(report["clocks"][1]["clock"], "virtual");
  EXPECT_GT(report["clocks"][1]["makespan_ns"], 0);
  for (const char* name : {"t.wall.json", "t.model.json"}) {
    std::ifstream in(dir / name);
    ASSERT_TRUE(in) << name;
    const auto trace = nlohmann::json::parse(in);
    EXPECT_GT(trace["traceEvents"].size(), 4u * 2 * 2);
  }
  std::ifstream dot(dir / "g.dot");
  std::string first;
  std::getline(dot, first);
  EXPECT_EQ(first.rfind("digraph", 0), 0u);
  std::filesystem::remove_all(dir);
}

}  // namespace
