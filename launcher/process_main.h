// What the main of every Tessera process shares: settings from the environment, an error
// printed the one way, and termination signals handled on a thread of their own.
//
// The scheduler's main (scheduler/scheduler_main.h), the worker's (worker/worker_main.h) and the
// `tessera` CLI (launcher/tessera_main.cc) use these; nothing here keeps state.
#pragma once

#include <functional>
#include <string_view>

#include "core/settings.h"
#include "core/status.h"

namespace tessera {

// The settings of this process (defaults overridden by TESSERA_<NAME> variables), with the log
// level applied. InvalidArgument naming the variable for a value that does not parse.
Result<Settings> LoadProcessSettings();

// Prints "<program>: error: <status>" on stderr and returns the exit code 1.
int FailWith(std::string_view program, const Status& status);

// Blocks SIGINT and SIGTERM in every thread (call it before any thread starts) and runs
// `on_signal` once, from a dedicated thread, when one arrives.
void HandleTerminationSignals(std::function<void()> on_signal);

}  // namespace tessera
