# The installable SDK: `cmake --install build --prefix P` gives
#
#   P/include/tessera/<module>/<header>.h   the public headers, at the paths the project's own
#                                           code includes them by ("client/cluster.h")
#   P/lib/libtessera_<module>.a             every module's static library
#   P/bin/tessera                           the CLI, which is also the scheduler and worker
#                                           processes Cluster::StartLocal starts
#   P/lib/cmake/Tessera/                    the CMake package: TesseraConfig.cmake, its version
#                                           file, the exported targets, TesseraOpenBlas.cmake,
#                                           TesseraFunctions.cmake (tessera_add_driver/_plugin)
#   P/share/tessera/data/                   the text the GPT-2 example trains on
#
# so that a project outside the tree writes
#
#   find_package(Tessera REQUIRED)
#   target_link_libraries(my_driver PRIVATE Tessera::tessera)
#
# (examples/out_of_tree/; scripts/test_install.sh checks it end to end, and builds every example
# and the example plugin that way). The example drivers' shared code (examples/common: flags,
# sessions, the training loop) is part of the SDK as Tessera::example_common.
#
# Public vs internal headers: each module lists its public headers with tessera_public_headers()
# in its CMakeLists.txt: what driver programs include, and what those include in turn. Only they
# are installed; every other header is internal to Tessera and may change without notice.
# scripts/test_install.sh compiles every installed header on its own against the install, so a
# public header that includes an internal one fails the test.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(TESSERA_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Tessera)
set(TESSERA_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/tessera)

# tessera_public_headers(<target> <header>...): installs the headers (paths relative to the
# current source directory) under include/tessera/<that directory>/.
function(tessera_public_headers target)
  file(RELATIVE_PATH module_dir ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  foreach(header IN LISTS ARGN)
    if(NOT EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${header})
      message(FATAL_ERROR "tessera_public_headers(${target}): ${module_dir}/${header} does not exist")
    endif()
    get_filename_component(header_dir ${module_dir}/${header} DIRECTORY)
    install(FILES ${header} DESTINATION ${TESSERA_INSTALL_INCLUDEDIR}/${header_dir})
  endforeach()
endfunction()

# The libraries, the umbrella target, the binary and the package. Called once every module's
# target exists.
function(tessera_install_sdk)
  # Every module's library, exported as Tessera::<module> (tessera_core -> Tessera::core).
  set(libraries tessera_core tessera_rpc tessera_transport tessera_ops tessera_ops_cpu
    tessera_collectives tessera_worker tessera_dashboard tessera_scheduler tessera_model
    tessera_planner tessera_data tessera_launch tessera_client tessera_training
    tessera_example_common)
  if(TARGET tessera_ops_cuda)  # the GPU kernels, which the driver links in a CUDA build
    list(APPEND libraries tessera_ops_cuda)
  endif()
  foreach(library IN LISTS libraries)
    string(REPLACE "tessera_" "" export_name ${library})
    set_target_properties(${library} PROPERTIES EXPORT_NAME ${export_name})
  endforeach()
  # tessera_warnings is linked privately by every module, so the export must carry it; its
  # options are build-only (BUILD_INTERFACE), so exported it is empty.
  set_target_properties(tessera_warnings PROPERTIES EXPORT_NAME internal_warnings)
  install(TARGETS ${libraries} tessera_sdk tessera_plugin_sdk tessera_warnings
    EXPORT TesseraTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(EXPORT TesseraTargets NAMESPACE Tessera:: DESTINATION ${TESSERA_INSTALL_CMAKEDIR})

  # The binary keeps the RPATH to the pthread OpenBLAS it was linked with (cmake/OpenBlas.cmake
  # says why that flavour matters).
  set_target_properties(tessera PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
  install(TARGETS tessera RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/TesseraConfig.cmake.in
    ${PROJECT_BINARY_DIR}/TesseraConfig.cmake
    INSTALL_DESTINATION ${TESSERA_INSTALL_CMAKEDIR}
    PATH_VARS CMAKE_INSTALL_BINDIR CMAKE_INSTALL_DATADIR)
  # 0.x: a minor version may break the API, so only the same minor version is compatible.
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/TesseraConfigVersion.cmake
    VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
  install(FILES
    ${PROJECT_BINARY_DIR}/TesseraConfig.cmake
    ${PROJECT_BINARY_DIR}/TesseraConfigVersion.cmake
    DESTINATION ${TESSERA_INSTALL_CMAKEDIR})
  install(FILES ${PROJECT_SOURCE_DIR}/cmake/OpenBlas.cmake
    DESTINATION ${TESSERA_INSTALL_CMAKEDIR} RENAME TesseraOpenBlas.cmake)
  install(FILES ${PROJECT_SOURCE_DIR}/cmake/Nifti.cmake
    DESTINATION ${TESSERA_INSTALL_CMAKEDIR} RENAME TesseraNifti.cmake)
  install(FILES ${PROJECT_SOURCE_DIR}/cmake/TesseraFunctions.cmake
    DESTINATION ${TESSERA_INSTALL_CMAKEDIR})
  # The text train_gpt2 trains on by default, for the example built out of tree.
  install(FILES ${PROJECT_SOURCE_DIR}/data/tinyshakespeare.txt
    DESTINATION ${CMAKE_INSTALL_DATADIR}/tessera/data)
endfunction()
