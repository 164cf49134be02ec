// The files a command will write, checked before any work starts: a run that trains for an hour
// and then cannot write its checkpoint, or that says it wrote a file it did not, has lost the
// user's time.
#pragma once

#include <string>

namespace weave::cli {

// Throws std::invalid_argument naming `flag`, the path and the fix when `path` cannot be written:
// its folder is missing or not writable, or the path is a folder or a file that cannot be
// replaced. Creates nothing. An empty path (the flag not given) passes.
void check_writable(const std::string& flag, const std::string& path);

}  // namespace weave::cli
