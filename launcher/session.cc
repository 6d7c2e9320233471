#include "launcher/session.h"

#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/atomic_file.h"
#include "launcher/process.h"

// The installed SDK's bin directory: defined (weakly) by the source that find_package(Tessera)
// adds to every target linking Tessera::tessera (cmake/TesseraConfig.cmake.in), so a program
// built out of tree knows where its SDK's `tessera` is even when the install was moved with
// `cmake --install --prefix`. Null in programs built inside the project.
extern "C" const char* tessera_sdk_bin_dir() __attribute__((weak));

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kPollInterval = std::chrono::milliseconds(20);

}  // namespace

TesseraBinaryPlaces TesseraBinaryPlaces::OfThisProcess(const std::string& flag) {
  const auto env = [](const char* name) {
    const char* value = std::getenv(name);
    return std::string(value != nullptr ? value : "");
  };
  TesseraBinaryPlaces places;
  places.flag = flag;
  places.env_binary = env("TESSERA_BINARY");
  places.env_bin_dir = env("TESSERA_BIN_DIR");
  places.executable_dir = ExecutableDirectory();
  if (tessera_sdk_bin_dir != nullptr) places.sdk_bin_dir = tessera_sdk_bin_dir();
#ifdef TESSERA_CONFIGURED_BIN_DIR
  places.configured_bin_dir = TESSERA_CONFIGURED_BIN_DIR;
#endif
  places.path = env("PATH");
  return places;
}

Result<std::string> FindTesseraBinaryIn(
    const TesseraBinaryPlaces& places,
    const std::function<bool(const std::string&)>& is_executable) {
  const auto executable = [&](const std::string& file) {
    if (is_executable) return is_executable(file);
    std::error_code error;
    return std::filesystem::is_regular_file(file, error) && ::access(file.c_str(), X_OK) == 0;
  };
  constexpr const char* kHowToFix =
      "install Tessera (`cmake --install build --prefix P`) and set TESSERA_BIN_DIR=P/bin or put "
      "P/bin on PATH, or point LocalClusterOptions::tessera_binary or TESSERA_BINARY at the binary";
  // Explicit choices: used, or reported, but never passed over.
  if (!places.flag.empty()) {
    if (executable(places.flag)) return places.flag;
    return NotFound("LocalClusterOptions::tessera_binary '{}' is not an executable file; {}",
                    places.flag, kHowToFix);
  }
  if (!places.env_binary.empty()) {
    if (executable(places.env_binary)) return places.env_binary;
    return NotFound("$TESSERA_BINARY '{}' is not an executable file; {}", places.env_binary,
                    kHowToFix);
  }
  if (!places.env_bin_dir.empty()) {
    const std::string file = places.env_bin_dir + "/tessera";
    if (executable(file)) return file;
    return NotFound("$TESSERA_BIN_DIR is '{}', but '{}' is not an executable file; {}",
                    places.env_bin_dir, file, kHowToFix);
  }
  std::vector<std::string> tried = {"$TESSERA_BIN_DIR (not set)"};
  const std::pair<std::string, std::string> implicit_places[] = {
      {places.executable_dir, "next to this executable"},
      {places.sdk_bin_dir, "the installed SDK this program was built against"},
      {places.configured_bin_dir, "the install prefix Tessera was configured with"}};
  for (const auto& [dir, what] : implicit_places) {
    if (dir.empty()) continue;
    const std::string file = dir + "/tessera";
    if (executable(file)) return file;
    tried.push_back(fmt::format("{} ({})", file, what));
  }
  size_t searched = 0;
  for (size_t begin = 0; begin <= places.path.size();) {
    size_t end = places.path.find(':', begin);
    if (end == std::string::npos) end = places.path.size();
    const std::string dir = places.path.substr(begin, end - begin);
    begin = end + 1;
    if (dir.empty()) continue;
    ++searched;
    if (executable(dir + "/tessera")) return dir + "/tessera";
  }
  tried.push_back(searched == 0
                      ? std::string("$PATH (empty)")
                      : fmt::format("the {} directories of $PATH ({})", searched, places.path));
  return NotFound(
      "cannot find the tessera binary (the scheduler and worker processes); tried {}; {}",
      fmt::join(tried, ", "), kHowToFix);
}

Result<std::string> FindTesseraBinary(const std::string& flag) {
  return FindTesseraBinaryIn(TesseraBinaryPlaces::OfThisProcess(flag));
}

Result<LocalSession> LocalSession::Create(const std::string& dir, const std::string& prefix,
                                          SessionProcesses processes) {
  std::error_code error;
  std::string path = dir;
  if (path.empty()) {
    const std::string root = SessionRoot(processes.temp_dir);
    const bool own_root = processes.temp_dir.empty();
    std::filesystem::create_directories(root, error);
    if (error) {
      return Unavailable(
          "cannot create the session root {}: {}; set TESSERA_TEMP_DIR (or "
          "--temp-dir) to a directory you may write",
          root, error.message());
    }
    if (own_root) {
      // The default root is this user's alone: its sessions hold tokens.
      struct stat info {};
      if (::stat(root.c_str(), &info) != 0 || info.st_uid != ::geteuid()) {
        return Unavailable(
            "the session root {} belongs to another user; set TESSERA_TEMP_DIR "
            "(or --temp-dir) to a directory of your own",
            root);
      }
      ::chmod(root.c_str(), 0700);
    }
    RemoveEndedSessions(root, kKeptEndedSessions, "");
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    ::localtime_r(&now, &local);
    std::strftime(stamp, sizeof(stamp), "%Y%m%d_%H%M%S", &local);
    // mkdtemp: a unique name even for sessions started in the same second by one process.
    std::string pattern = fmt::format("{}/{}_{}_{}_XXXXXX", root, prefix, stamp, ::getpid());
    if (::mkdtemp(pattern.data()) == nullptr) {
      return Unavailable("cannot create a session directory under {}: {}", root,
                         std::strerror(errno));
    }
    path = pattern;
  } else {
    std::filesystem::create_directories(path, error);
    if (error)
      return Unavailable("cannot create session directory '{}': {}", path, error.message());
  }
  TESSERA_ASSIGN_OR_RETURN(std::string token, RandomToken());
  LocalSession session(path, token, std::move(processes));
  TESSERA_RETURN_IF_ERROR(WriteFileAtomically(session.token_file(), token + "\n", 0600));
  return session;
}

Result<LocalSession> LocalSession::Open(const std::string& dir, SessionProcesses processes) {
  Result<std::string> token = ReadFileTrimmed(dir + "/token");
  if (!token.ok() || token->empty()) {
    return NotFound("'{}' is not a Tessera session: it has no token file ({})", dir,
                    token.ok() ? "empty" : token.status().message());
  }
  return LocalSession(dir, *token, std::move(processes));
}

Result<LocalSession> LocalSession::ForToken(const std::string& token_file,
                                            SessionProcesses processes) {
  const std::filesystem::path path(token_file);
  if (path.filename() == "token") return Open(path.parent_path().string(), std::move(processes));
  Result<std::string> token = ReadFileTrimmed(token_file);
  if (!token.ok() || token->empty()) {
    return NotFound("cannot read the cluster token at '{}'; pass --token-file", token_file);
  }
  TESSERA_ASSIGN_OR_RETURN(LocalSession session, Create("", "node", std::move(processes)));
  session.token_ = *token;
  TESSERA_RETURN_IF_ERROR(WriteFileAtomically(session.token_file(), *token + "\n", 0600));
  return session;
}

std::string LocalSession::LogTail(const std::string& log) {
  Result<std::string> text = ReadFileTrimmed(log);
  if (!text.ok() || text->empty()) return std::string();
  return "; its log ends: " + text->substr(text->size() > 600 ? text->size() - 600 : 0);
}

std::vector<std::string> LocalSession::SchedulerArgv(const SchedulerLaunch& launch) const {
  std::vector<std::string> argv = {processes_.binary,  "scheduler",
                                   "--host",           launch.host,
                                   "--port",           std::to_string(launch.port),
                                   "--token-file",     token_file(),
                                   "--session-dir",    dir_,
                                   "--address-file",   address_file(),
                                   "--unix-socket",    dir_ + "/scheduler.sock",
                                   "--dashboard-file", dashboard_file()};
  if (launch.dashboard_port != SchedulerLaunch::kDashboardPortFromSettings) {
    argv.insert(argv.end(), {"--dashboard-port", std::to_string(launch.dashboard_port)});
  }
  if (launch.restart) argv.push_back("--restart");
  return argv;
}

Result<StartedScheduler> LocalSession::StartScheduler(const SchedulerLaunch& launch) {
  std::error_code ignored;
  std::filesystem::remove(address_file(), ignored);
  std::filesystem::remove(dashboard_file(), ignored);
  const std::string log = dir_ + "/scheduler.log";
  StartedScheduler started;
  started.local_address = "unix:" + dir_ + "/scheduler.sock";
  TESSERA_ASSIGN_OR_RETURN(
      started.pid,
      SpawnProcess(SchedulerArgv(launch), SpawnOptions{.log_file = log,
                                                       .die_with_parent = !processes_.detached,
                                                       .new_session = processes_.detached}));
  const auto deadline = Clock::now() + std::chrono::milliseconds(launch.timeout_ms);
  while (true) {
    Result<std::string> address = ReadFileTrimmed(address_file());
    if (address.ok() && !address->empty()) {
      started.address = *address;
      // Written before the address file when the scheduler has a dashboard.
      if (Result<std::string> dashboard = ReadFileTrimmed(dashboard_file()); dashboard.ok()) {
        started.dashboard = *dashboard;
      }
      break;
    }
    if (!ProcessAlive(started.pid)) {
      return Unavailable("the scheduler exited during start-up{}", LogTail(log));
    }
    if (Clock::now() > deadline) {
      StopProcess(started.pid, 1000);
      return TimedOut("the scheduler did not start within {} ms{}", launch.timeout_ms,
                      LogTail(log));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  TESSERA_RETURN_IF_ERROR(
      WriteFileAtomically(dir_ + "/scheduler.pid", std::to_string(started.pid) + "\n"));
  RecordProcess("scheduler", started.pid);
  return started;
}

std::string LocalSession::WorkerName(const WorkerLaunch& launch, int index) const {
  return launch.tag.empty() ? std::to_string(index) : fmt::format("{}-{}", launch.tag, index);
}

Result<std::vector<pid_t>> LocalSession::StartWorkers(const WorkerLaunch& launch) {
  if (launch.count < 1) {
    return InvalidArgument("start at least one worker (asked for {})", launch.count);
  }
  std::vector<pid_t> pids;
  for (int i = 0; i < launch.count; ++i) {
    const std::string name = WorkerName(launch, i);
    std::vector<std::string> command = {processes_.binary,  "worker",
                                        "--address",        launch.scheduler,
                                        "--token-file",     token_file(),
                                        "--threads",        std::to_string(launch.threads),
                                        "--host-memory-mb", std::to_string(launch.host_memory_mb),
                                        "--spill-dir",      fmt::format("{}/spill-{}", dir_, name)};
    if (launch.host_cap_gib > 0) {
      command.insert(command.end(), {"--host-cap-gib", fmt::format("{}", launch.host_cap_gib)});
    }
    if (!launch.cpus.empty()) {
      command.insert(command.end(),
                     {"--cpus", launch.cpus[static_cast<size_t>(i) % launch.cpus.size()]});
    }
    if (!launch.gpus.empty()) {
      command.insert(
          command.end(),
          {"--gpu", std::to_string(launch.gpus[static_cast<size_t>(i) % launch.gpus.size()]),
           "--gpu-memory-gib", fmt::format("{}", launch.gpu_memory_gib)});
    }
    Result<pid_t> pid =
        SpawnProcess(command, SpawnOptions{.log_file = fmt::format("{}/worker-{}.log", dir_, name),
                                           .die_with_parent = !processes_.detached,
                                           .new_session = processes_.detached,
                                           .environment = launch.environment});
    if (!pid.ok()) {
      for (pid_t started : pids) StopProcess(started, 1000);
      return pid.status();
    }
    pids.push_back(*pid);
    RecordProcess("worker-" + name, *pid);
  }
  return pids;
}

Status LocalSession::AwaitWorkers(const std::function<Result<int>()>& count_alive, int target,
                                  const std::vector<pid_t>& started, const WorkerLaunch& launch,
                                  int timeout_ms) const {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  int alive = 0;
  while (true) {
    Result<int> counted = count_alive();
    if (counted.ok()) alive = *counted;
    if (alive >= target) return Status::Ok();
    for (size_t i = 0; i < started.size(); ++i) {
      if (!ProcessAlive(started[i])) {
        const std::string name = WorkerName(launch, static_cast<int>(i));
        return Unavailable("worker {} exited during start-up{}", name,
                           LogTail(fmt::format("{}/worker-{}.log", dir_, name)));
      }
    }
    if (Clock::now() > deadline) {
      return TimedOut("only {} of {} workers joined within {} ms (logs in {})", alive, target,
                      timeout_ms, dir_);
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

std::string SessionRoot(const std::string& temp_dir) {
  if (!temp_dir.empty()) return temp_dir;
  std::string user = std::to_string(::geteuid());
  passwd entry{};
  passwd* found = nullptr;
  std::vector<char> buffer(16384);
  if (::getpwuid_r(::geteuid(), &entry, buffer.data(), buffer.size(), &found) == 0 &&
      found != nullptr && found->pw_name != nullptr && *found->pw_name != '\0') {
    user = found->pw_name;
  }
  return "/tmp/tessera-" + user;
}

std::string LatestSession(const std::string& temp_dir) {
  return SessionRoot(temp_dir) + "/session_latest";
}

Result<std::string> SchedulerAddressOrLatest(const std::string& flag, const std::string& temp_dir) {
  if (!flag.empty()) return flag;
  const std::string latest = LatestSession(temp_dir);
  Result<std::string> address = ReadFileTrimmed(latest + "/scheduler.address");
  if (!address.ok()) {
    return NotFound(
        "no --address given and no running session found ({}); start one with `tessera start "
        "--head` (or pass --temp-dir / TESSERA_TEMP_DIR where it was started)",
        latest);
  }
  // A driver killed before it could take its link back leaves it on an ended session.
  std::error_code error;
  if (const std::string session = std::filesystem::canonical(latest, error).string();
      !SessionRuns(session)) {
    return NotFound(
        "no --address given, and the latest session ({}) has ended: its processes exited; start "
        "a cluster with `tessera start --head`, or pass --address",
        session);
  }
  return address;
}

std::string TokenFileOrLatest(const std::string& flag, const std::string& temp_dir) {
  return flag.empty() ? LatestSession(temp_dir) + "/token" : flag;
}

Result<std::string> LinkLatestSession(const std::string& root, const std::string& dir) {
  const std::filesystem::path link = std::filesystem::path(root) / "session_latest";
  std::error_code error;
  std::string previous = std::filesystem::read_symlink(link, error).string();
  if (error) previous.clear();
  const std::filesystem::path temporary =
      std::filesystem::path(root) / fmt::format(".session_latest.{}", ::getpid());
  std::filesystem::remove(temporary, error);
  std::filesystem::create_directory_symlink(dir, temporary, error);
  if (!error) std::filesystem::rename(temporary, link, error);
  if (error) {
    std::filesystem::remove(temporary, error);
    return Unavailable("cannot link {} to the session {}: {}", link.string(), dir, error.message());
  }
  return previous;
}

void UnlinkLatestSession(const std::string& root, const std::string& dir,
                         const std::string& previous) {
  const std::filesystem::path link = std::filesystem::path(root) / "session_latest";
  std::error_code error;
  if (std::filesystem::read_symlink(link, error).string() != dir || error) return;
  if (!previous.empty() && SessionRuns(previous) && LinkLatestSession(root, previous).ok()) {
    return;
  }
  std::filesystem::remove(link, error);
}

bool SessionRuns(const std::string& dir) {
  std::vector<pid_t> pids;
  std::ifstream listed(dir + "/pids");
  std::string name;
  for (long pid = 0; listed >> name >> pid;) pids.push_back(static_cast<pid_t>(pid));
  if (Result<std::string> scheduler = ReadFileTrimmed(dir + "/scheduler.pid"); scheduler.ok()) {
    pids.push_back(static_cast<pid_t>(std::atol(scheduler->c_str())));
  }
  // kill(pid, 0), not ProcessAlive: that reaps an exited child, which is its ChildReaper's to
  // reap (a session of a cluster this process started). A zombie counts as running: kept.
  return std::any_of(pids.begin(), pids.end(),
                     [](pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); });
}

int RemoveEndedSessions(const std::string& root, int keep, const std::string& except) {
  std::error_code error;
  const auto now = std::filesystem::file_time_type::clock::now();
  std::vector<std::pair<std::filesystem::file_time_type, std::filesystem::path>> ended;
  for (const auto& entry : std::filesystem::directory_iterator(root, error)) {
    std::error_code ignored;
    if (entry.is_symlink(ignored) || !entry.is_directory(ignored)) continue;
    const std::filesystem::path& dir = entry.path();
    if (dir.string() == except || !std::filesystem::exists(dir / "token", ignored)) continue;
    const auto changed = std::filesystem::last_write_time(dir, ignored);
    if (ignored || now - changed < std::chrono::minutes(1)) continue;  // may be starting
    if (SessionRuns(dir.string())) continue;
    ended.emplace_back(changed, dir);
  }
  std::sort(ended.begin(), ended.end(), [](const auto& a, const auto& b) { return a > b; });
  int removed = 0;
  for (size_t i = static_cast<size_t>(std::max(keep, 0)); i < ended.size(); ++i) {
    std::error_code ignored;
    if (std::filesystem::remove_all(ended[i].second, ignored) > 0 && !ignored) ++removed;
  }
  return removed;
}

void LocalSession::RecordProcess(const std::string& name, pid_t pid) const {
  // One short line appended: atomic with O_APPEND, so concurrent `tessera start`s do not mix.
  std::ofstream pids(dir_ + "/pids", std::ios::app);
  pids << name << ' ' << pid << '\n';
}

}  // namespace tessera
