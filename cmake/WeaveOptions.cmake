option(WEAVE_NATIVE "Compile for this host's instruction set (-march=native)" ON)
# Tests and benchmarks are weave's own: a project that adds weave as a subproject gets neither
# (nor their GoogleTest and Google Benchmark requirements) unless it asks.
option(WEAVE_BUILD_TESTS "Build the GoogleTest suite" ${PROJECT_IS_TOP_LEVEL})
option(WEAVE_BUILD_BENCHMARKS "Build the Google Benchmark programs" ${PROJECT_IS_TOP_LEVEL})
# The `weave` program (and its CLI11 requirement): a project embedding the libraries does not
# need it unless it asks.
option(WEAVE_BUILD_PROGRAM "Build the weave command-line program" ${PROJECT_IS_TOP_LEVEL})
option(WEAVE_WARNINGS_AS_ERRORS "Treat compiler warnings as errors" OFF)
option(WEAVE_BUILD_FUZZERS "Build the libFuzzer targets of tests/fuzz (clang; see tools/dev fuzz)" OFF)
set(WEAVE_SANITIZE "" CACHE STRING "Sanitizer to build with: '', address, thread or undefined")

# Flags shared by every weave target, carried by this interface library. Every target links it
# privately: warnings, -O3 and -march=native are how weave is built, not what its users must
# compile with, so nothing of it reaches a consumer's targets or the installed package.
add_library(weave_flags INTERFACE)
# Designated initializers that leave members at their defaults are the intended way to fill
# TaskSpec and friends; GCC warns about them under -Wextra.
target_compile_options(weave_flags INTERFACE -Wall -Wextra -Wpedantic -Wno-missing-field-initializers)
if(WEAVE_WARNINGS_AS_ERRORS)
  target_compile_options(weave_flags INTERFACE -Werror)
endif()
if(CMAKE_BUILD_TYPE STREQUAL "Release")
  # A test program's own code builds inputs, compares and asserts; the time it runs is the
  # libraries' (-O3). The targets that set WEAVE_TEST_PROGRAM (the tests and their shared
  # precompiled header) compile at -Og, which builds a test file in about 60 % of -O3's time.
  # Floating point results do not depend on the level: ISO C++ mode contracts no multiply-add
  # and nothing reorders a sum.
  #
  # The command-line code (WEAVE_COMMAND_LINE: weave_cli, the weave program) parses flags, checks
  # them and prints; the work it starts is the libraries'. It compiles at -O1, in about 75 % of
  # -O3's time (CLI11's templates are most of it).
  target_compile_options(
    weave_flags
    INTERFACE
      $<IF:$<BOOL:$<TARGET_PROPERTY:WEAVE_TEST_PROGRAM>>,-Og,$<IF:$<BOOL:$<TARGET_PROPERTY:WEAVE_COMMAND_LINE>>,-O1,-O3>>
  )
endif()
# LLVM's linker (Debian's lld) links a test program in a sixth of GNU ld's time (0.5 s against
# 2.8 s with AddressSanitizer); weave links about seventy programs in each build. Used for weave's
# own programs when the compiler can use it: a consumer's targets never see it.
option(WEAVE_USE_LLD "Link weave's programs with lld when the compiler can" ON)
if(WEAVE_USE_LLD)
  include(CheckLinkerFlag)
  check_linker_flag(CXX -fuse-ld=lld WEAVE_LINKER_LLD_WORKS)
  if(WEAVE_LINKER_LLD_WORKS)
    target_link_options(weave_flags INTERFACE -fuse-ld=lld)
  endif()
endif()
if(WEAVE_NATIVE)
  # GCC 12 tunes -march=native for an older core on Zen 4 and Eigen's GEMM loses about a third
  # of its speed; generic tuning keeps the native instruction set without that penalty.
  target_compile_options(weave_flags INTERFACE -march=native -mtune=generic)
endif()
if(WEAVE_SANITIZE)
  target_compile_options(weave_flags INTERFACE -fsanitize=${WEAVE_SANITIZE} -fno-omit-frame-pointer)
  target_link_options(weave_flags INTERFACE -fsanitize=${WEAVE_SANITIZE})
  # A sanitized build exists to run the tests once, so it is compiled for compile time: GCC's
  # -O2 with full debug information and instrumentation takes about five times -Og with line
  # tables (which still name every frame's file and line in a report). A target whose speed
  # the tests need sets WEAVE_OPTIMIZED_UNDER_SANITIZERS and keeps -O2 (the kernels). Coming
  # after the build type's flags, these win.
  #
  # Clang instruments -Og code at about twice the cost of -O0 (a test file or a command of
  # weave_cli, with AddressSanitizer and UBSan). The test programs and the command-line code
  # (WEAVE_TEST_PROGRAM, WEAVE_COMMAND_LINE) spend little of the tests' time, so
  # clang builds them at -O0; the libraries the tests run stay at -Og. GCC's -O0 is slower to
  # build than its -Og and keeps -Og.
  set(unoptimized_level -Og)
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    set(unoptimized_level -O0)
  endif()
  set(unoptimized
      "$<OR:$<BOOL:$<TARGET_PROPERTY:WEAVE_TEST_PROGRAM>>,$<BOOL:$<TARGET_PROPERTY:WEAVE_COMMAND_LINE>>>"
  )
  target_compile_options(
    weave_flags
    INTERFACE
      $<IF:$<BOOL:$<TARGET_PROPERTY:WEAVE_OPTIMIZED_UNDER_SANITIZERS>>,-O2,$<IF:${unoptimized},${unoptimized_level},-Og>>
      -g1)
  # At -O2 UndefinedBehaviorSanitizer's checks of every pointer step and load of Eigen's inlined
  # kernels double the kernels' compile time (ops/src/gemm.cpp and attention.cpp: 2.2x, measured
  # with GCC 12), in each build that has them. Those four checks are left out of the optimized
  # targets only: AddressSanitizer already catches an access outside an object, the kernels make
  # no virtual calls (vptr), and they read weave's own tensors, aligned to their element type by
  # construction (Eigen maps them as unaligned); signed overflow, shifts, bounds, null and the
  # rest stay on.
  if(WEAVE_SANITIZE MATCHES "undefined")
    target_compile_options(
      weave_flags
      INTERFACE $<$<BOOL:$<TARGET_PROPERTY:WEAVE_OPTIMIZED_UNDER_SANITIZERS>>:-fno-sanitize=alignment,object-size,vptr,pointer-overflow>
    )
  endif()
endif()
