// The logs of a session directory (launcher/session.h says what one holds), by the names a user
// knows its processes by: `tessera logs` and the dashboard's logs view read them.
//
// A session's processes write scheduler.log and worker-<tag>.log (the tag is the launcher's:
// "0", "1234-0", ...). A worker that joined links its log as <id>.log ("worker2.log"), the id
// `tessera status` and the dashboard show (LinkOwnLogAs, from the worker process). So a log is
// named "scheduler", "worker2", or, for a worker that never joined, its file's stem
// ("worker-0").
//
// Only this host's session: a worker on another host keeps its log in that host's session.
//
// Thread safety: free functions over the file system; no state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace tessera {

struct SessionLog {
  std::string name;  // "scheduler", "worker2", "worker-0" (above)
  std::string file;  // its path (a worker id's link resolved to the file it names)
  int64_t bytes = 0;
  int64_t modified_unix_s = 0;
};

// The logs of `dir`: the scheduler's first, then workers by id number, then the logs no id links
// to by name. Empty when `dir` holds none (or cannot be read).
std::vector<SessionLog> ListSessionLogs(const std::string& dir);

// The log of `dir` named `name` (a SessionLog name, or a file name ending in .log). NotFound
// naming the session and the names it has; InvalidArgument for a name with a '/'.
Result<SessionLog> FindSessionLog(const std::string& dir, const std::string& name);

// The end of `file`: its last `lines` lines (all when lines <= 0), at most `max_bytes` of them
// (the first partial line then dropped). NotFound naming the file when it cannot be read.
Result<std::string> TailOfFile(const std::string& file, int lines, int64_t max_bytes);

// This process's log, when its standard error goes to a regular file <dir>/<something>.log:
// links it as <dir>/<name>.log (relative, replacing an older link atomically). Nothing
// otherwise (a terminal, a pipe). Unavailable naming the link when it cannot be made.
Status LinkOwnLogAs(const std::string& name);

}  // namespace tessera
