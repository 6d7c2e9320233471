#include "launcher/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <thread>
#include <vector>

#include "core/checks.h"

namespace tessera {

Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) return InvalidArgument("no program to start");
  if (::access(argv[0].c_str(), X_OK) != 0) {
    return Unavailable("cannot run '{}': {}", argv[0], std::strerror(errno));
  }
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  // The child's environment, built before fork (the child may only make async-signal-safe
  // calls): this process's, each of options.environment replacing its name's entry.
  std::vector<std::string> variables;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view variable(*entry);
    const bool replaced =
        std::any_of(options.environment.begin(), options.environment.end(), [&](const auto& set) {
          return variable.size() > set.first.size() && variable.starts_with(set.first) &&
                 variable[set.first.size()] == '=';
        });
    if (!replaced) variables.emplace_back(variable);
  }
  for (const auto& [name, value] : options.environment) {
    variables.push_back(name);
    variables.back().append("=").append(value);
  }
  std::vector<char*> envp;
  envp.reserve(variables.size() + 1);
  for (std::string& variable : variables) envp.push_back(variable.data());
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return SystemError("fork");
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    if (options.new_session) ::setsid();
    if (options.die_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);  // the parent died before prctl took effect
    }
    if (!options.log_file.empty()) {
      const int fd =
          ::open(options.log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
      }
      const int null_fd = ::open("/dev/null", O_RDONLY);
      if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
    }
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

bool ProcessAlive(pid_t pid) {
  int status = 0;
  const pid_t reaped = ::waitpid(pid, &status, WNOHANG);
  if (reaped == pid) return false;                                // our child, now reaped
  if (reaped < 0 && errno == ECHILD) return ::kill(pid, 0) == 0;  // not our child
  return ::kill(pid, 0) == 0;
}

void StopProcess(pid_t pid, int timeout_ms) {
  if (!ProcessAlive(pid)) return;
  ::kill(pid, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (!ProcessAlive(pid)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

ChildReaper::ChildReaper(std::chrono::milliseconds period)
    : period_(period), thread_([this] { Loop(); }) {}

ChildReaper::~ChildReaper() { Stop(); }

void ChildReaper::Add(pid_t pid) {
  MutexLock lock(&mutex_);
  pids_.push_back(pid);
}

std::vector<pid_t> ChildReaper::Children() const {
  MutexLock lock(&mutex_);
  return pids_;
}

std::vector<pid_t> ChildReaper::Stop() {
  {
    MutexLock lock(&mutex_);
    stopping_ = true;
    wake_.NotifyAll();
  }
  if (thread_.joinable()) thread_.join();
  MutexLock lock(&mutex_);
  return pids_;
}

void ChildReaper::Loop() {
  MutexLock lock(&mutex_);
  while (!stopping_) {
    ReapExited();
    wake_.WaitFor(&mutex_, period_);
  }
}

void ChildReaper::ReapExited() {
  std::erase_if(pids_, [](pid_t pid) {
    int status = 0;
    const pid_t reaped = ::waitpid(pid, &status, WNOHANG);
    return reaped == pid || (reaped < 0 && errno == ECHILD);
  });
}

std::string ExecutableDirectory() {
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::string(".") : exe.parent_path().string();
}

Result<std::string> RandomToken() {
  std::ifstream random("/dev/urandom", std::ios::binary);
  unsigned char bytes[32];
  if (!random.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    return Unavailable("cannot read /dev/urandom for the cluster token");
  }
  std::string token;
  for (unsigned char b : bytes) token += fmt::format("{:02x}", b);
  return token;
}

}  // namespace tessera
