# Functions for programs and plugins built with Tessera, the same in Tessera's tree (the top-level
# CMakeLists.txt includes this file) and against an installed Tessera (TesseraConfig.cmake does),
# so that each example's CMakeLists.txt builds either way (scripts/test_install.sh builds every
# example out of tree).
#
#   tessera_add_driver(<name> SOURCES <src>... LIBS <target>... [DEFINITIONS <def>...])
#     A driver program. Its sources compile as an object library that does not wait for the
#     `tessera` binary, so in Tessera's tree they build beside the libraries and only the link
#     waits for `tessera` (which --workers starts): a two-core build keeps both cores busy to the
#     end (the README's first command). It links Tessera::tessera besides LIBS (installed, that
#     says where the SDK's `tessera` binary is), and exports its symbols (-rdynamic), which the
#     plugins it loads resolve Tessera's functions against (ops/plugin.h).
#
#   tessera_add_plugin(<name> SOURCES <src>...)
#     lib<name>.so: a plugin of ops and kernels (ops/plugin.h), compiled against Tessera's
#     headers and linking no Tessera library (the loading process provides them). Records the
#     SDK's version for the loader's messages.
include_guard(GLOBAL)

function(tessera_add_driver name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS;DEFINITIONS" ${ARGN})
  add_library(${name}_objects OBJECT ${ARG_SOURCES})
  target_link_libraries(${name}_objects PRIVATE ${ARG_LIBS})
  if(TARGET tessera_warnings)  # Tessera's own warnings, in its tree only
    target_link_libraries(${name}_objects PRIVATE tessera_warnings)
  endif()
  if(ARG_DEFINITIONS)
    target_compile_definitions(${name}_objects PRIVATE ${ARG_DEFINITIONS})
  endif()
  add_executable(${name} $<TARGET_OBJECTS:${name}_objects>)
  # Tessera::tessera too: installed, it carries where the SDK's `tessera` binary is, which
  # Cluster::StartLocal looks for (TesseraConfig.cmake).
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} Tessera::tessera)
  set_target_properties(${name} PROPERTIES ENABLE_EXPORTS ON)
  if(TARGET tessera)  # in Tessera's tree: the binary --workers starts is built first
    add_dependencies(${name} tessera)
  endif()
endfunction()

function(tessera_add_plugin name)
  cmake_parse_arguments(ARG "" "" "SOURCES" ${ARGN})
  add_library(${name} MODULE ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE Tessera::plugin_sdk)
  if(TARGET tessera_warnings)
    target_link_libraries(${name} PRIVATE tessera_warnings)
  endif()
  # Only the entry point (TESSERA_PLUGIN) is exported; "lib<name>.so" as for any library.
  set_target_properties(${name} PROPERTIES PREFIX "lib" CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_compile_definitions(${name} PRIVATE
    TESSERA_PLUGIN_SDK_VERSION="${TESSERA_SDK_VERSION}")
endfunction()
