# Installs the library and exports a CMake package: find_package(flashattn) -> flashattn::flashattn.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS flashattn EXPORT flashattnTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  # Also exports the include directory: on a first configure the target's own
  # $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}> is empty (GNUInstallDirs comes later).
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/flashattn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT flashattnTargets NAMESPACE flashattn::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)

# The config finds a static library's private dependencies (OpenMP, CUDA runtime) for its
# consumers; a shared library needs none.
get_target_property(_flashattn_type flashattn TYPE)
if(_flashattn_type STREQUAL "STATIC_LIBRARY")
  set(FLASHATTN_PACKAGE_STATIC ON)
else()
  set(FLASHATTN_PACKAGE_STATIC OFF)
endif()
configure_package_config_file(cmake/flashattnConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/flashattnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)
