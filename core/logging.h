// Logging: one spdlog logger per component ("worker", "executor", "train", ...).
//
// Loggers write to stderr so a program's stdout stays machine-readable (train_gpt2 prints its
// step lines and summary there). Later issues add a per-session log directory for processes.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <spdlog/spdlog.h>

#include "core/status.h"

namespace tessera {

// The logger of `component`, created on first use at the current level.
std::shared_ptr<spdlog::logger> GetLogger(const std::string& component);

// Sets the level of every logger, present and future. InvalidArgument for an unknown level.
Status SetLogLevel(std::string_view level);

}  // namespace tessera
