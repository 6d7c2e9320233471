#include "core/checks.h"

#include <cstring>

namespace tessera {

std::string CallSite(const std::source_location& where) {
  std::string_view file = where.file_name();
  const size_t slash = file.rfind('/');
  if (slash != std::string_view::npos) file.remove_prefix(slash + 1);
  return fmt::format("{}:{}", file, where.line());
}

Status SystemError(std::string_view what, int error, StatusCode code, std::source_location where) {
  return Status(code,
                fmt::format("{} failed: {} (at {})", what, std::strerror(error), CallSite(where)));
}

}  // namespace tessera
