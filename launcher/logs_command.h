// `tessera logs`: a session's logs by the names `tessera status` shows (core/session_logs.h).
//
//   tessera logs                           the latest session's logs: name, size, last change
//   tessera logs scheduler | worker2       the end of one (-n LINES, 100; 0: all)
//   tessera logs worker2 -f                ... and what it writes next, until the session ends
//   tessera logs --session-dir DIR ...     another session (default: the latest one under the
//                                          session root: --temp-dir / TESSERA_TEMP_DIR)
//
// Only this host's session: a worker on another host keeps its log in that host's session
// (`ssh HOST tessera logs --session-dir ...`).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace tessera {

struct LogsCommandFlags {
  std::string name;  // empty: list them
  std::string session_dir;
  int lines = 100;
  bool follow = false;
};

CLI::App* AddLogsCommand(CLI::App& app, LogsCommandFlags& flags);

// Runs it with `temp_dir` (the temp_dir setting) naming the session root. Exit status: 0, or 1
// with the error on stderr.
int RunLogsCommand(const LogsCommandFlags& flags, const std::string& temp_dir);

}  // namespace tessera
