#include "core/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include "core/thread_annotations.h"

namespace tessera {

std::shared_ptr<spdlog::logger> GetLogger(const std::string& component) {
  // Get-or-create in one step: two threads asking for a new component must not both create it
  // (spdlog refuses a second logger of the same name).
  static Mutex mutex;
  MutexLock lock(&mutex);
  if (auto logger = spdlog::get(component)) return logger;
  auto logger = spdlog::stderr_color_mt(component);
  logger->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
  logger->set_level(spdlog::get_level());
  return logger;
}

Status SetLogLevel(std::string_view level) {
  spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  if (parsed == spdlog::level::off && level != "off") {
    return InvalidArgument("unknown log level '{}' (trace, debug, info, warn, error, off)", level);
  }
  spdlog::set_level(parsed);  // applies to every registered logger and the default for new ones
  return Status::Ok();
}

}  // namespace tessera
