#include "output_paths.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <stdexcept>

namespace weave::cli {

void check_writable(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (fs::is_directory(p, ec))
    throw std::invalid_argument(
        fmt::format("{} '{}' is a folder: name a file to write, such as '{}'", flag, path,
                    (p / (flag == "--save" ? "model.ckpt" : "out")).string()));
  const fs::path folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(folder, ec))
    throw std::invalid_argument(
        fmt::format("{} '{}': the folder '{}' does not exist: create it (mkdir -p {}) or name "
                    "another path",
                    flag, path, folder.string(), folder.string()));
  // Writing a new file, or replacing one through a rename, needs the folder writable; writing
  // over a file in place needs the file writable.
  if (::access(folder.c_str(), W_OK | X_OK) != 0)
    throw std::invalid_argument(fmt::format(
        "{} '{}': the folder '{}' is not writable: name a path in a folder you can write to", flag,
        path, folder.string()));
  if (fs::exists(p, ec) && ::access(p.c_str(), W_OK) != 0)
    throw std::invalid_argument(fmt::format(
        "{} '{}' exists and is not writable: name another path or make it writable", flag, path));
}

}  // namespace weave::cli
