#include "core/session_logs.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace tessera {

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kLogSuffix = ".log";

// The number of "worker<N>"; -1 for any other name.
int64_t WorkerNumber(const std::string& name) {
  constexpr std::string_view kWorker = "worker";
  if (!name.starts_with(kWorker) || name.size() == kWorker.size()) return -1;
  int64_t number = 0;
  for (size_t i = kWorker.size(); i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i])) || number > (int64_t{1} << 40)) {
      return -1;
    }
    number = number * 10 + (name[i] - '0');
  }
  return number;
}

int64_t UnixSeconds(fs::file_time_type time) {
  const auto system = std::chrono::time_point_cast<std::chrono::seconds>(
      time - fs::file_time_type::clock::now() + std::chrono::system_clock::now());
  return system.time_since_epoch().count();
}

}  // namespace

std::vector<SessionLog> ListSessionLogs(const std::string& dir) {
  std::map<std::string, SessionLog> by_file;           // the files, by resolved path
  std::vector<std::pair<int64_t, SessionLog>> linked;  // worker ids' links, with their mtimes
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string file_name = entry.path().filename().string();
    if (!file_name.ends_with(kLogSuffix)) continue;
    std::error_code ignored;
    const fs::path target = fs::canonical(entry.path(), ignored);
    if (ignored || !fs::is_regular_file(target, ignored)) continue;
    SessionLog log;
    log.name = file_name.substr(0, file_name.size() - kLogSuffix.size());
    log.file = target.string();
    log.bytes = static_cast<int64_t>(fs::file_size(target, ignored));
    log.modified_unix_s = UnixSeconds(fs::last_write_time(target, ignored));
    if (struct stat link{};
        entry.is_symlink(ignored) && ::lstat(entry.path().c_str(), &link) == 0) {
      linked.emplace_back(
          static_cast<int64_t>(link.st_mtim.tv_sec) * 1'000'000'000 + link.st_mtim.tv_nsec,
          std::move(log));
    } else if (!entry.is_symlink(ignored)) {
      by_file[log.file] = std::move(log);
    }
  }
  // A file a worker id links to goes by the id (the newest link when a restarted scheduler gave
  // the worker another one).
  std::vector<SessionLog> logs;
  std::sort(linked.begin(), linked.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (auto& [linked_at, log] : linked) {
    if (by_file.erase(log.file) > 0) logs.push_back(std::move(log));
  }
  for (auto& [file, log] : by_file) logs.push_back(std::move(log));
  std::stable_sort(logs.begin(), logs.end(), [](const SessionLog& a, const SessionLog& b) {
    const auto rank = [](const SessionLog& log) {
      if (log.name == "scheduler") return std::pair<int, int64_t>{0, 0};
      const int64_t number = WorkerNumber(log.name);
      return number >= 0 ? std::pair<int, int64_t>{1, number} : std::pair<int, int64_t>{2, 0};
    };
    const auto ra = rank(a), rb = rank(b);
    return ra != rb ? ra < rb : (ra.first == 2 && a.name < b.name);
  });
  return logs;
}

Result<SessionLog> FindSessionLog(const std::string& dir, const std::string& name) {
  if (name.find('/') != std::string::npos) {
    return InvalidArgument("'{}' is not a log's name (scheduler, worker2, ...)", name);
  }
  const std::string wanted =
      name.ends_with(kLogSuffix) ? name.substr(0, name.size() - kLogSuffix.size()) : name;
  const std::vector<SessionLog> logs = ListSessionLogs(dir);
  std::vector<std::string> names;
  for (const SessionLog& log : logs) {
    if (log.name == wanted) return log;
    names.push_back(log.name);
  }
  // A worker id's log may also be reached by its file's own stem.
  for (const SessionLog& log : logs) {
    if (fs::path(log.file).stem().string() == wanted) return log;
  }
  if (names.empty()) return NotFound("the session {} holds no logs", dir);
  return NotFound(
      "no log named '{}' in the session {}: it has {} (a worker on another host keeps its log "
      "in that host's session)",
      name, dir, fmt::join(names, ", "));
}

Result<std::string> TailOfFile(const std::string& file, int lines, int64_t max_bytes) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return NotFound("cannot read {}", file);
  in.seekg(0, std::ios::end);
  const int64_t size = static_cast<int64_t>(in.tellg());
  const int64_t start = max_bytes > 0 && size > max_bytes ? size - max_bytes : 0;
  in.seekg(start);
  std::string text(static_cast<size_t>(size - start), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (start > 0) {  // the first line is cut: drop it
    const size_t newline = text.find('\n');
    text.erase(0, newline == std::string::npos ? text.size() : newline + 1);
  }
  if (lines > 0) {
    size_t from = text.size();
    if (from > 0 && text[from - 1] == '\n') --from;  // the last line's own newline
    for (int seen = 0; from > 0; --from) {
      if (text[from - 1] == '\n' && ++seen == lines) break;
    }
    text.erase(0, from);
  }
  return text;
}

Status LinkOwnLogAs(const std::string& name) {
  std::error_code error;
  const fs::path log = fs::read_symlink("/proc/self/fd/2", error);
  if (error || !log.is_absolute() || log.extension() != kLogSuffix ||
      !fs::is_regular_file(log, error)) {
    return Status::Ok();  // not a log file
  }
  const fs::path link = log.parent_path() / (name + std::string(kLogSuffix));
  if (link == log) return Status::Ok();
  const fs::path temporary =
      log.parent_path() / fmt::format(".{}{}.{}", name, kLogSuffix, ::getpid());
  fs::remove(temporary, error);
  fs::create_symlink(log.filename(), temporary, error);
  if (!error) fs::rename(temporary, link, error);
  if (error) {
    fs::remove(temporary, error);
    return Unavailable("cannot link {} to {}: {}", link.string(), log.string(), error.message());
  }
  return Status::Ok();
}

}  // namespace tessera
