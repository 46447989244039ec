# `make install PREFIX=...` and `make package` (cmake --install / cpack): the `pathways` binary, the
# client library with its headers and a CMake package config (find_package(pathways), target
# pathways::client), and the Python package. Two components, so that the Debian packages split
# as Debian's do: `runtime` (binary, shared library, Python) and `dev` (headers, CMake files).
include(CMakePackageConfigHelpers)

install(TARGETS pathways RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
install(TARGETS pathways_client EXPORT pathwaysTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)

# The client's public headers and those they include, at their paths in src/ under
# include/pathways (they include each other as "core/types.h"; users write <pathways/client/client.h>).
# tests/install_test.cc compiles an outside program against exactly these.
set(PATHWAYS_PUBLIC_HEADERS
  client/client.h client/program.h client/optimizer.h client/version.h
  core/future.h core/executor.h core/types.h core/ids.h
  array/sharding.h compute/function_body.h)
foreach(header ${PATHWAYS_PUBLIC_HEADERS})
  get_filename_component(dir ${header} DIRECTORY)
  install(FILES ${CMAKE_SOURCE_DIR}/src/${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/pathways/${dir}
          COMPONENT dev)
endforeach()

set(PATHWAYS_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/pathways)
install(EXPORT pathwaysTargets NAMESPACE pathways:: DESTINATION ${PATHWAYS_CMAKE_DIR} COMPONENT dev)
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/pathwaysConfig.cmake.in
  ${CMAKE_BINARY_DIR}/pathwaysConfig.cmake INSTALL_DESTINATION ${PATHWAYS_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/pathwaysConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/pathwaysConfig.cmake ${CMAKE_BINARY_DIR}/pathwaysConfigVersion.cmake
  DESTINATION ${PATHWAYS_CMAKE_DIR} COMPONENT dev)

if(TARGET _pathways)
  # Where Debian's /usr/bin/python3 looks for packages under a prefix.
  install(DIRECTORY ${CMAKE_BINARY_DIR}/python/pathways DESTINATION lib/python3/dist-packages
          COMPONENT runtime PATTERN __pycache__ EXCLUDE)
endif()

# What the packages hold, and all that `make install` and `make package` build (not the tests and
# benchmarks: an image's build stage needs only these). Installing does not build everything
# first, so `cmake --build build --target install` (or cpack) wants `packaged` built before it.
add_custom_target(packaged)
add_dependencies(packaged pathways pathways_client)
if(TARGET pathways_python)
  add_dependencies(packaged pathways_python)
endif()
set(CMAKE_SKIP_INSTALL_ALL_DEPENDENCY ON)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME pathways)
set(CPACK_PACKAGE_VENDOR "the pathways authors")
set(CPACK_PACKAGE_CONTACT "pathways maintainers <pathways@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Single-controller runtime for clusters of ML accelerators")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME pathways)
set(CPACK_DEBIAN_DEV_PACKAGE_NAME pathways-dev)
# The runtime's shared-library dependencies come from dpkg-shlibdeps (dpkg-dev); Python's torch is
# what the Python package imports for tensors.
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS "python3, python3-torch")
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "pathways (= ${PROJECT_VERSION}), libabsl-dev, cmake")
set(CPACK_DEBIAN_PACKAGE_SECTION science)
include(CPack)
