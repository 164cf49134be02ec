// A folder of its own under the system's temporary folder for one test, removed with everything
// in it when the test ends; its name carries the process id and a random number so tests running
// at once (ctest -j) never share one.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>

namespace weave::graphs {

struct TempDir {
  std::filesystem::path path;

  explicit TempDir(const std::string& name) {
    path = std::filesystem::temp_directory_path() /
           fmt::format("weave_{}_{}_{}", name, ::getpid(), std::random_device{}());
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // A file (or a dataset's prefix) in the folder.
  std::string prefix(const std::string& name) const { return (path / name).string(); }
};

}  // namespace weave::graphs
