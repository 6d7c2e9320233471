// What this build is: Tessera's version and how it was built (build type, compiler, whether the
// CUDA backend is in it and for which architectures). Every binary's --version prints
// VersionLine; `tessera doctor` starts with BuildDescription.
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <string_view>

namespace tessera {

// The project's version (CMake's project() version), "0.1.0".
const char* TesseraVersion();

// "Tessera 0.1.0 (Release build, GCC 12.2.0, CUDA backend for sm_90)", or "..., no CUDA
// backend)".
std::string BuildDescription();

// "<program>: <BuildDescription()>".
std::string VersionLine(std::string_view program);

}  // namespace tessera
