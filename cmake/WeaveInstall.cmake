# `cmake --install` puts the libraries, their public headers, the `weave` program and a CMake
# package (weaveConfig.cmake, its version file and the exported targets weave::runtime,
# weave::devices, weave::ops, weave::pipeline_schedule, weave::graphs and weave::weave) under the
# prefix, so that another project finds it with find_package(weave) alone. Headers under src/
# and the tests and benchmarks are not installed. `cpack -G DEB` makes a Debian package of the same tree.
include(CMakePackageConfigHelpers)

# All of weave, for programs that want every layer.
add_library(weave_all INTERFACE)
target_link_libraries(weave_all INTERFACE weave_graphs weave_pipeline_schedule weave_ops
                                          weave_devices weave_runtime)
set_target_properties(weave_all PROPERTIES EXPORT_NAME weave)
add_library(weave::weave ALIAS weave_all)

set(WEAVE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/weave)

install(TARGETS weave_runtime weave_devices weave_ops weave_pipeline_schedule weave_graphs weave_all
        EXPORT weaveTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(WEAVE_BUILD_PROGRAM)
  install(TARGETS weave RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
foreach(layer runtime devices ops graphs)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/include/
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          FILES_MATCHING PATTERN "*.hpp")
endforeach()
install(EXPORT weaveTargets NAMESPACE weave:: DESTINATION ${WEAVE_CMAKE_DIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/weaveConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/weaveConfig.cmake
                              INSTALL_DESTINATION ${WEAVE_CMAKE_DIR})
# 0.x: a minor version may change the API, so only the same minor version is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/weaveConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/weaveConfig.cmake ${PROJECT_BINARY_DIR}/weaveConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/WeaveFindDnnl.cmake
        DESTINATION ${WEAVE_CMAKE_DIR})

if(PROJECT_IS_TOP_LEVEL)
  set(CPACK_PACKAGE_NAME weave)
  set(CPACK_PACKAGE_VENDOR "weave")
  set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
      "Task-graph runtime for distributed training on one shared-memory host")
  set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
  set(CPACK_PACKAGE_CONTACT "weave maintainers")
  set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
  set(CPACK_DEBIAN_PACKAGE_SECTION devel)
  # What the installed package's CMake configuration and headers need.
  set(CPACK_DEBIAN_PACKAGE_DEPENDS
      "libtbb-dev, libhwloc-dev, libfmt-dev, nlohmann-json3-dev, libdnnl-dev, pkg-config, cmake (>= 3.25)")
  if(WEAVE_MPI)
    string(APPEND CPACK_DEBIAN_PACKAGE_DEPENDS ", libopenmpi-dev")
  endif()
  set(CPACK_GENERATOR DEB)
  include(CPack)
endif()
