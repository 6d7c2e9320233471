#include "core/settings.h"

#include <cctype>
#include <charconv>
#include <cstdlib>

namespace tessera {

namespace {

std::string EnvName(std::string_view setting) {
  std::string name = "TESSERA_";
  for (char c : setting) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

Status ParseValue(const std::string& text, int64_t* out) {
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), *out);
  if (error != std::errc() || end != text.data() + text.size()) {
    return InvalidArgument("'{}' is not an integer", text);
  }
  return Status::Ok();
}

Status ParseValue(const std::string& text, bool* out) {
  if (text == "1" || text == "true" || text == "on") {
    *out = true;
  } else if (text == "0" || text == "false" || text == "off") {
    *out = false;
  } else {
    return InvalidArgument("'{}' is not a boolean (use 1/0, true/false, on/off)", text);
  }
  return Status::Ok();
}

// " (unit)" after a range, or nothing.
std::string Unit(std::string_view unit) {
  return unit.empty() ? std::string() : fmt::format(" ({})", unit);
}

Status ParseValue(const std::string& text, std::string* out) {
  *out = text;
  return Status::Ok();
}

}  // namespace

Result<Settings> Settings::FromEnvironment(const EnvLookup& getenv) {
  Settings settings;
#define TESSERA_SETTING(type, name, default_value, unit, description)                    \
  if (std::optional<std::string> text = getenv(EnvName(#name))) {                        \
    TESSERA_RETURN_IF_ERROR(                                                             \
        ParseValue(*text, &settings.name).WithContext("environment " + EnvName(#name))); \
  }
#define TESSERA_INT_SETTING(name, default_value, min, max, unit, description)                   \
  TESSERA_SETTING(int64_t, name, default_value, unit, description)                              \
  if (settings.name < (min) || settings.name > (max)) {                                         \
    return InvalidArgument("{}={} is out of range: it must be from {} to {}{}", EnvName(#name), \
                           settings.name, min, max, Unit(unit));                                \
  }
#include "core/settings_def.h"
#undef TESSERA_INT_SETTING
#undef TESSERA_SETTING
  if (settings.heartbeat_timeout_ms <= settings.heartbeat_interval_ms) {
    return InvalidArgument(
        "TESSERA_HEARTBEAT_TIMEOUT_MS={} must be above TESSERA_HEARTBEAT_INTERVAL_MS={}: a worker "
        "would be declared dead between two of its heartbeats",
        settings.heartbeat_timeout_ms, settings.heartbeat_interval_ms);
  }
  return settings;
}

Result<Settings> Settings::FromProcessEnvironment() {
  return FromEnvironment([](const std::string& variable) -> std::optional<std::string> {
    const char* value = std::getenv(variable.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

std::string Settings::Describe() {
  std::string text;
#define TESSERA_SETTING(type, name, default_value, unit, description)       \
  text += fmt::format("  {}={}{} -- {}\n", EnvName(#name), Settings{}.name, \
                      std::string_view(unit).empty() ? "" : " (" unit ")", description);
#define TESSERA_INT_SETTING(name, default_value, min, max, unit, description)        \
  text += fmt::format("  {}={} ({}{}..{}) -- {}\n", EnvName(#name), Settings{}.name, \
                      std::string_view(unit).empty() ? "" : unit ", ", min, max, description);
#include "core/settings_def.h"
#undef TESSERA_INT_SETTING
#undef TESSERA_SETTING
  return text;
}

}  // namespace tessera
