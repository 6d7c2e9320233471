#include "core/version.h"

#include <fmt/format.h>

namespace tessera {

namespace {

std::string Compiler() {
#if defined(__clang__)
  return fmt::format("Clang {}.{}.{}", __clang_major__, __clang_minor__, __clang_patchlevel__);
#elif defined(__GNUC__)
  return fmt::format("GCC {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
#else
  return "an unknown compiler";
#endif
}

}  // namespace

const char* TesseraVersion() { return TESSERA_VERSION_STRING; }

std::string BuildDescription() {
  const std::string_view build_type = TESSERA_BUILD_TYPE;
#if TESSERA_HAVE_CUDA  // defined in every build: 1 or 0
  const std::string cuda = fmt::format("CUDA backend for sm_{}", TESSERA_CUDA_ARCHITECTURES);
#else
  const std::string cuda = "no CUDA backend";
#endif
  return fmt::format("Tessera {} ({} build, {}, {})", TesseraVersion(),
                     build_type.empty() ? "unnamed" : build_type, Compiler(), cuda);
}

std::string VersionLine(std::string_view program) {
  return fmt::format("{}: {}", program, BuildDescription());
}

}  // namespace tessera
