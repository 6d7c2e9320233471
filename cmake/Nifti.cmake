# Locates the NIfTI reference library (Debian's libnifti2-dev: nifti2_io and znzlib) and exposes
# it as the imported target tessera::nifti. Used by Tessera's build and, installed as
# TesseraNifti.cmake, by its CMake package, since tessera::data links it.
#
# Debian 12's own NIFTIConfig.cmake cannot be used: its targets point at /usr/lib/libznz.so.3.0.0,
# where the package does not put the library (it is in the multiarch directory).
find_path(TESSERA_NIFTI_INCLUDE_DIR nifti2_io.h PATH_SUFFIXES nifti)
find_library(TESSERA_NIFTI2_LIBRARY NAMES nifti2)
find_library(TESSERA_ZNZ_LIBRARY NAMES znz)
find_package(ZLIB REQUIRED)
if(NOT TESSERA_NIFTI_INCLUDE_DIR OR NOT TESSERA_NIFTI2_LIBRARY OR NOT TESSERA_ZNZ_LIBRARY)
  message(FATAL_ERROR
    "The NIfTI library (nifti2_io.h, libnifti2, libznz) was not found. Install it with: "
    "apt-get install libnifti2-dev (or run scripts/install_deps.sh).")
endif()
if(NOT TARGET tessera::nifti)
  add_library(tessera::nifti UNKNOWN IMPORTED)
  set_target_properties(tessera::nifti PROPERTIES
    IMPORTED_LOCATION ${TESSERA_NIFTI2_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${TESSERA_NIFTI_INCLUDE_DIR}
    INTERFACE_LINK_LIBRARIES "${TESSERA_ZNZ_LIBRARY};ZLIB::ZLIB;m")
endif()
