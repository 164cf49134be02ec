// Runs the built `weave` program (WEAVE_BINARY) with arguments and captures what it prints, for
// the end-to-end command tests: through a pipe, or on a pseudo-terminal.
#pragma once

#include <fmt/format.h>

#include <pty.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

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

// Runs the program on a pseudo-terminal `columns` wide (as a user's terminal is, COLUMNS unset)
// and returns what it drew there.
inline Result weave_on_terminal(const std::vector<std::string>& args, int columns) {
  winsize size{};
  size.ws_col = static_cast<unsigned short>(columns);
  size.ws_row = 24;
  int terminal = -1;
  const pid_t child = forkpty(&terminal, nullptr, nullptr, &size);
  if (child < 0) return {-1, "forkpty failed"};
  if (child == 0) {
    ::unsetenv("COLUMNS");
    std::vector<char*> argv{const_cast<char*>(WEAVE_BINARY)};
    for (const std::string& a : args)
      argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(WEAVE_BINARY, argv.data());
    std::_Exit(127);
  }
  Result r{-1, {}};
  std::array<char, 4096> buffer{};
  for (;;) {
    const ssize_t n = ::read(terminal, buffer.data(), buffer.size());
    if (n <= 0) break;  // EIO once the program has exited and closed the terminal
    r.out.append(buffer.data(), static_cast<std::size_t>(n));
  }
  ::close(terminal);
  int status = 0;
  ::waitpid(child, &status, 0);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace weave::cli_test
