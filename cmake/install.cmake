# Installs the library and exports a CMake package: find_package(flashattn) -> flashattn::flashattn.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS flashattn EXPORT flashattnTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/flashattn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT flashattnTargets NAMESPACE flashattn::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)

configure_package_config_file(cmake/flashattnConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/flashattnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)
