# Locates a single-threaded OpenBLAS and exposes it as tessera::blas.
#
# Why serial: Tessera owns its threads (one TBB arena per executor) and splits large GEMMs
# itself. A threaded OpenBLAS would start a second pool whose spinning threads compete with TBB
# for the same cores. Debian ships the serial build beside the pthread one under the same
# soname (libopenblas.so.0), so we link it by full path; CMake records its directory in the
# RPATH, which the loader searches before the system-wide alternative.
set(_tessera_blas_arch_dir /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE})
find_library(TESSERA_OPENBLAS_LIBRARY NAMES openblas
  PATHS ${_tessera_blas_arch_dir}/openblas-serial NO_DEFAULT_PATH)
find_path(TESSERA_OPENBLAS_INCLUDE_DIR cblas.h
  PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-serial NO_DEFAULT_PATH)
if(NOT TESSERA_OPENBLAS_LIBRARY OR NOT TESSERA_OPENBLAS_INCLUDE_DIR)
  message(FATAL_ERROR
    "Single-threaded OpenBLAS not found. Install it with: apt-get install libopenblas-serial-dev "
    "(or run scripts/install_deps.sh).")
endif()
add_library(tessera_blas INTERFACE)
target_link_libraries(tessera_blas INTERFACE ${TESSERA_OPENBLAS_LIBRARY})
target_include_directories(tessera_blas SYSTEM INTERFACE ${TESSERA_OPENBLAS_INCLUDE_DIR})
add_library(tessera::blas ALIAS tessera_blas)
message(STATUS "tessera: OpenBLAS (serial) ${TESSERA_OPENBLAS_LIBRARY}")
