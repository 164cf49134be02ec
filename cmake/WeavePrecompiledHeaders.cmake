# Precompiled headers. Nearly half of a weave source's compile time is parsing the same standard
# library, fmt, oneTBB and (in the tests) GoogleTest headers again: a test of the graphs layer
# preprocesses to about 140,000 lines of which weave's own are a few thousand. Each library parses
# them once into a precompiled header and every test shares one, which matters most where the
# suite is built four times (Release, the two sanitizer builds and the fuzz build).
#
# The headers listed are the ones weave's sources include most; a source still includes what it
# uses (the precompiled header is forced in first, so a forgotten include would go unnoticed here:
# tools/package_check compiles the public headers without it). ccache cannot cache a source
# compiled with a precompiled header unless told to (sloppiness pch_defines,time_macros), so a
# build through ccache may turn this off.
option(WEAVE_PRECOMPILE_HEADERS "Precompile the standard, fmt, oneTBB and GoogleTest headers" ON)

set(weave_common_precompiled_headers
    <algorithm> <array> <atomic> <chrono> <cmath> <cstddef> <cstdint> <cstdlib> <functional>
    <map> <memory> <mutex> <optional> <span> <stdexcept> <string> <string_view> <unordered_map>
    <utility> <variant> <vector> <fmt/format.h> <tbb/task_arena.h>)

# weave_precompile_headers(<target> [<header>...]): the common headers and the target's own extra
# ones, parsed once for that target.
function(weave_precompile_headers target)
  if(WEAVE_PRECOMPILE_HEADERS)
    target_precompile_headers(${target} PRIVATE ${weave_common_precompiled_headers} ${ARGN})
  endif()
endfunction()

# weave_share_precompiled_headers(<target> <from>): <target> uses <from>'s precompiled header,
# which is only valid (and only used: GCC falls back to parsing the headers otherwise) when both
# are compiled with the same flags and definitions, as the tests are.
function(weave_share_precompiled_headers target from)
  if(WEAVE_PRECOMPILE_HEADERS)
    target_precompile_headers(${target} REUSE_FROM ${from})
  endif()
endfunction()
