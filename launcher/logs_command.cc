#include "launcher/logs_command.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/flag_checks.h"
#include "core/session_logs.h"
#include "launcher/process_main.h"
#include "launcher/session.h"

namespace tessera {

namespace {

constexpr int64_t kMostBytesShown = int64_t{8} << 20;  // of one log's end, without -n 0

std::string LocalTime(int64_t unix_s) {
  const auto seconds = static_cast<std::time_t>(unix_s);
  std::tm local{};
  ::localtime_r(&seconds, &local);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &local);
  return text;
}

// Prints what `file` gains from byte `offset` on, polling, until the session stops running.
void Follow(const std::string& file, const std::string& session_dir, int64_t offset) {
  std::ifstream in(file, std::ios::binary);
  std::string chunk(1 << 16, '\0');
  int quiet_polls = 0;
  while (true) {
    in.clear();
    in.seekg(offset);
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const auto got = static_cast<int64_t>(in.gcount());
    if (got > 0) {
      std::fwrite(chunk.data(), 1, static_cast<size_t>(got), stdout);
      std::fflush(stdout);
      offset += got;
      quiet_polls = 0;
      continue;
    }
    // Checked every 2 s of quiet: a session whose processes all exited writes nothing more.
    if (++quiet_polls % 10 == 0 && !SessionRuns(session_dir)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace

CLI::App* AddLogsCommand(CLI::App& app, LogsCommandFlags& flags) {
  CLI::App* command = app.add_subcommand(
      "logs", "List the latest session's logs, or print one: scheduler, or a worker by its id");
  command->add_option("name", flags.name,
                      "scheduler, or a worker's id as `tessera status` shows it (worker2); "
                      "none: list them");
  command->add_option("-n,--lines", flags.lines, "How many of its last lines (0: all)")
      ->check(AtLeast(0));
  command->add_flag("-f,--follow", flags.follow,
                    "Keep printing what it writes, until the session's processes exit");
  command->add_option("--session-dir", flags.session_dir,
                      "The session (default: the latest one under the session root)");
  return command;
}

int RunLogsCommand(const LogsCommandFlags& flags, const std::string& temp_dir) {
  std::string dir = flags.session_dir;
  if (dir.empty()) {
    std::error_code error;
    const std::string latest = LatestSession(temp_dir);
    dir = std::filesystem::canonical(latest, error).string();
    if (error) {
      return FailWith("tessera",
                      NotFound("no session to read logs from: {} does not name one (start a "
                               "cluster, or pass --session-dir or --temp-dir)",
                               latest));
    }
  }
  if (flags.name.empty()) {
    const std::vector<SessionLog> logs = ListSessionLogs(dir);
    if (logs.empty()) {
      return FailWith("tessera", NotFound("the session {} holds no logs", dir));
    }
    std::printf("Logs of the session %s (%s)\n", dir.c_str(),
                SessionRuns(dir) ? "running" : "ended");
    std::printf("%-16s %12s  %-19s  %s\n", "name", "bytes", "last written", "file");
    for (const SessionLog& log : logs) {
      std::printf("%-16s %12lld  %-19s  %s\n", log.name.c_str(), static_cast<long long>(log.bytes),
                  LocalTime(log.modified_unix_s).c_str(),
                  std::filesystem::path(log.file).filename().c_str());
    }
    std::printf("tessera logs NAME prints one (-n LINES, -f to follow)\n");
    return 0;
  }
  Result<SessionLog> log = FindSessionLog(dir, flags.name);
  if (!log.ok()) return FailWith("tessera", log.status());
  Result<std::string> tail =
      TailOfFile(log->file, flags.lines, flags.lines == 0 ? 0 : kMostBytesShown);
  if (!tail.ok()) return FailWith("tessera", tail.status());
  std::fwrite(tail->data(), 1, tail->size(), stdout);
  std::fflush(stdout);
  if (flags.follow) {
    std::error_code error;
    Follow(log->file, dir, static_cast<int64_t>(std::filesystem::file_size(log->file, error)));
  }
  return 0;
}

}  // namespace tessera
