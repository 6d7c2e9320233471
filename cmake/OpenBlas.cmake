# Locates OpenBLAS and exposes it as the imported target tessera::blas. Used by Tessera's build
# and, installed as TesseraOpenBlas.cmake, by its CMake package (find_package(Tessera)), so a
# program linking the installed libraries gets the same OpenBLAS.
#
# Tessera owns its threads (one TBB arena per executor), splits large GEMMs itself and calls
# BLAS concurrently from several threads, each call single-threaded. That needs an OpenBLAS
# built with locking around its buffer pool: Debian's "pthread" flavour has it (set to one
# thread at start-up by ops/cpu/blas.cc); its "serial" flavour does not (SINGLE_THREADED, no
# locks) and returns wrong results under concurrent calls. Both flavours share the soname
# libopenblas.so.0, so we link the pthread one by full path; CMake records its directory in the
# RPATH, which the loader searches before the system-wide alternative.
set(_tessera_blas_arch_dir /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE})
find_library(TESSERA_OPENBLAS_LIBRARY NAMES openblas
  PATHS ${_tessera_blas_arch_dir}/openblas-pthread NO_DEFAULT_PATH)
find_path(TESSERA_OPENBLAS_INCLUDE_DIR cblas.h
  PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-pthread NO_DEFAULT_PATH)
if(NOT TESSERA_OPENBLAS_LIBRARY OR NOT TESSERA_OPENBLAS_INCLUDE_DIR)
  message(FATAL_ERROR
    "OpenBLAS (pthread flavour) not found. Install it with: apt-get install libopenblas-dev "
    "libopenblas-pthread-dev (or run scripts/install_deps.sh).")
endif()
if(NOT TARGET tessera::blas)
  add_library(tessera::blas UNKNOWN IMPORTED)
  set_target_properties(tessera::blas PROPERTIES
    IMPORTED_LOCATION ${TESSERA_OPENBLAS_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${TESSERA_OPENBLAS_INCLUDE_DIR})
endif()
message(STATUS "tessera: OpenBLAS ${TESSERA_OPENBLAS_LIBRARY}")
