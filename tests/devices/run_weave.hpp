// Runs the built `weave` program (WEAVE_BINARY) with arguments and captures what it prints, for
// the end-to-end command tests.
#pragma once

#include <fmt/format.h>

#include <sys/wait.h>
#include <array>
#include <cstdio>
#include <string>

namespace weave::cli_test {

struct Result {
  int status;       // the exit code, or -1 if the program did not exit normally
  std::string out;  // stdout and stderr
};

inline Result weave(const std::string& args) {
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

}  // namespace weave::cli_test
