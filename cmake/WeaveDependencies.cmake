# Every dependency is a Debian package; tools/dev installs them. Nothing is downloaded here.
find_package(Threads REQUIRED)
find_package(TBB REQUIRED COMPONENTS tbb)
find_package(fmt REQUIRED)
find_package(nlohmann_json REQUIRED)
if(WEAVE_BUILD_PROGRAM)
  find_package(CLI11 REQUIRED)
endif()
find_package(Eigen3 3.4 REQUIRED NO_MODULE)
# Random123 is header-only and ships no CMake package.
find_path(RANDOM123_INCLUDE_DIR Random123/philox.h REQUIRED)
add_library(Random123 INTERFACE IMPORTED)
target_include_directories(Random123 INTERFACE ${RANDOM123_INCLUDE_DIR})
# oneDNN (libdnnl-dev) for the 16-bit matrix products. Debian's dnnl-config.cmake also asks for
# OpenCL's development files (its GPU runtime, which weave does not use), so the library is found
# directly and given the target name oneDNN's own package uses.
include(${CMAKE_CURRENT_LIST_DIR}/WeaveFindDnnl.cmake)
# Debian's oneDNN threads with OpenMP: weave sets the OpenMP thread count of the threads that call
# it (ops/src/gemm_bf16.cpp), so it links the OpenMP runtime itself.
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(PkgConfig REQUIRED)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
# Open MPI (libopenmpi-dev) for the multi-process backend: used when found, unless WEAVE_MPI is
# set OFF; weave builds without it.
if(NOT DEFINED WEAVE_MPI OR WEAVE_MPI)
  # The C API from C++, without the deprecated C++ bindings.
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI COMPONENTS CXX)
endif()
option(WEAVE_MPI "Build the multi-process backend over MPI (MpiCommunicator)" ${MPI_CXX_FOUND})
if(WEAVE_MPI AND NOT MPI_CXX_FOUND)
  message(FATAL_ERROR "WEAVE_MPI is ON but no MPI was found: install libopenmpi-dev "
                      "(tools/dev does) or configure with -DWEAVE_MPI=OFF")
endif()
if(WEAVE_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(WEAVE_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()
