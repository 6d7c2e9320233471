#include "driver/session.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "core/atomic_file.h"
#include "driver/process.h"

namespace tessera {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kPollInterval = std::chrono::milliseconds(20);

}  // namespace

Result<std::string> FindTesseraBinary(const std::string& flag) {
  std::string binary = flag;
  if (binary.empty()) {
    const char* env = std::getenv("TESSERA_BINARY");
    binary = env != nullptr ? env : ExecutableDirectory() + "/tessera";
  }
  if (::access(binary.c_str(), X_OK) != 0) {
    return NotFound("cannot find the tessera binary at '{}' (build it, or set TESSERA_BINARY)",
                    binary);
  }
  return binary;
}

Result<LocalSession> LocalSession::Create(const std::string& dir, const std::string& prefix,
                                          SessionProcesses processes) {
  std::error_code error;
  std::string path = dir;
  if (path.empty()) {
    std::filesystem::create_directories(kSessionRoot, error);
    if (error) {
      return Unavailable("cannot create the session root {}: {}", kSessionRoot, error.message());
    }
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    ::localtime_r(&now, &local);
    std::strftime(stamp, sizeof(stamp), "%Y%m%d_%H%M%S", &local);
    // mkdtemp: a unique name even for sessions started in the same second by one process.
    std::string pattern =
        fmt::format("{}/{}_{}_{}_XXXXXX", kSessionRoot, prefix, stamp, ::getpid());
    if (::mkdtemp(pattern.data()) == nullptr) {
      return Unavailable("cannot create a session directory under {}: {}", kSessionRoot,
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
  std::vector<std::string> argv = {processes_.binary, "scheduler",
                                   "--host",          launch.host,
                                   "--port",          std::to_string(launch.port),
                                   "--token-file",    token_file(),
                                   "--session-dir",   dir_,
                                   "--address-file",  address_file(),
                                   "--unix-socket",   dir_ + "/scheduler.sock"};
  if (launch.restart) argv.push_back("--restart");
  return argv;
}

Result<StartedScheduler> LocalSession::StartScheduler(const SchedulerLaunch& launch) {
  std::error_code ignored;
  std::filesystem::remove(address_file(), ignored);
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
    Result<pid_t> pid =
        SpawnProcess({processes_.binary, "worker", "--address", launch.scheduler, "--token-file",
                      token_file(), "--threads", std::to_string(launch.threads), "--host-memory-mb",
                      std::to_string(launch.host_memory_mb), "--spill-dir",
                      fmt::format("{}/spill-{}", dir_, name)},
                     SpawnOptions{.log_file = fmt::format("{}/worker-{}.log", dir_, name),
                                  .die_with_parent = !processes_.detached,
                                  .new_session = processes_.detached});
    if (!pid.ok()) {
      for (pid_t started : pids) StopProcess(started, 1000);
      return pid.status();
    }
    pids.push_back(*pid);
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

}  // namespace tessera
