# DNNL::dnnl: oneDNN from Debian's libdnnl-dev, for weave's build and for its installed package.
#
# Debian's own dnnl-config.cmake cannot be used as is: built with an OpenCL GPU runtime, it
# requires OpenCL's development package, which weave (CPU only) has no use for. The shared
# library and headers are found directly; the imported target takes the name oneDNN's package
# gives it, so a project that already found oneDNN its own way shares the target.
if(NOT TARGET DNNL::dnnl)
  find_path(WEAVE_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
  find_library(WEAVE_DNNL_LIBRARY dnnl)
  if(NOT WEAVE_DNNL_INCLUDE_DIR OR NOT WEAVE_DNNL_LIBRARY)
    message(FATAL_ERROR "weave needs oneDNN (oneapi/dnnl/dnnl.hpp and libdnnl): install "
                        "libdnnl-dev (tools/dev does)")
  endif()
  add_library(DNNL::dnnl SHARED IMPORTED)
  set_target_properties(DNNL::dnnl PROPERTIES IMPORTED_LOCATION ${WEAVE_DNNL_LIBRARY}
                                              INTERFACE_INCLUDE_DIRECTORIES ${WEAVE_DNNL_INCLUDE_DIR})
endif()
