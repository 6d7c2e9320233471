// Settings: the one place every Tessera knob lives.
//
// The knobs themselves are declared in settings_def.h (one line each with unit, default and
// trade-off). A Settings value is built once at start-up, from defaults overridden by the
// environment (TESSERA_CPU_THREADS=2, ...), and passed to the components that need it; nothing
// reads the environment behind the caller's back.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "core/status.h"

namespace tessera {

struct Settings {
#define TESSERA_SETTING(type, name, default_value, unit, description) type name = default_value;
#define TESSERA_INT_SETTING(name, default_value, min, max, unit, description) \
  int64_t name = default_value;
#include "core/settings_def.h"
#undef TESSERA_INT_SETTING
#undef TESSERA_SETTING

  // Reads the variable of each setting through `getenv` (injected for tests; nullopt when
  // unset) and overrides the default. InvalidArgument naming the variable on a malformed value,
  // on an integer outside the setting's range ("TESSERA_CPU_THREADS=-1 is out of range: it must
  // be from 0 to 4096 (threads)"), and when heartbeat_timeout_ms is not above
  // heartbeat_interval_ms.
  using EnvLookup = std::function<std::optional<std::string>(const std::string& variable)>;
  static Result<Settings> FromEnvironment(const EnvLookup& getenv);
  // Same, reading the process environment.
  static Result<Settings> FromProcessEnvironment();

  // One line per setting: "TESSERA_CPU_THREADS=0 (threads, 0..4096) -- description".
  static std::string Describe();
};

}  // namespace tessera
