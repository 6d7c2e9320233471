#include "core/checks.h"

#include <cstring>

namespace tessera {

std::string CallSite(const char* file, int line) {
  std::string_view name = file;
  const size_t slash = name.rfind('/');
  if (slash != std::string_view::npos) name.remove_prefix(slash + 1);
  return fmt::format("{}:{}", name, line);
}

Status SystemError(std::string_view what, int error, StatusCode code, const char* file, int line) {
  return Status(
      code, fmt::format("{} failed: {} (at {})", what, std::strerror(error), CallSite(file, line)));
}

}  // namespace tessera
