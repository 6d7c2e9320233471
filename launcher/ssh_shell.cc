#include "launcher/ssh_shell.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "client/cluster.h"

namespace tessera::launcher {
namespace {

// The IPv4 address `host` resolves to, or `host` itself.
std::string ResolveIpv4(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return host;
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr, text,
              sizeof(text));
  ::freeaddrinfo(found);
  return text;
}

}  // namespace

std::vector<std::string> SshArgv(const SshShellOptions& options, const std::string& host,
                                 const std::string& user, const std::string& command) {
  std::vector<std::string> argv = {options.ssh_binary,
                                   "-o",
                                   "BatchMode=yes",
                                   "-o",
                                   fmt::format("ConnectTimeout={}", options.ssh.connect_timeout_s),
                                   "-o",
                                   "ServerAliveInterval=5",
                                   "-o",
                                   "ServerAliveCountMax=3",
                                   "-o",
                                   "StrictHostKeyChecking=accept-new",
                                   "-o",
                                   "LogLevel=ERROR",
                                   "-p",
                                   std::to_string(options.ssh.port)};
  if (!options.known_hosts.empty()) {
    argv.insert(argv.end(), {"-o", "UserKnownHostsFile=" + options.known_hosts});
  }
  if (!options.ssh.key.empty()) {
    argv.insert(argv.end(), {"-i", options.ssh.key, "-o", "IdentitiesOnly=yes"});
  }
  for (const std::string& option : options.ssh.options) argv.insert(argv.end(), {"-o", option});
  const std::string& login = user.empty() ? options.ssh.user : user;
  argv.push_back(login.empty() ? host : login + "@" + host);
  argv.push_back("--");
  argv.push_back(command);
  return argv;
}

bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host.starts_with("127.");
}

Result<pid_t> Spawn(const std::vector<std::string>& argv, int input_fd, int output_fd,
                    bool new_session) {
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return Unavailable("fork: {}", std::strerror(errno));
  if (pid == 0) {  // only async-signal-safe calls until exec
    if (new_session) {
      ::setsid();
    } else {
      ::setpgid(0, 0);
    }
    ::dup2(input_fd, STDIN_FILENO);
    ::dup2(output_fd, STDOUT_FILENO);
    ::dup2(output_fd, STDERR_FILENO);
    ::signal(SIGPIPE, SIG_DFL);
    ::execvp(args[0], args.data());
    const char message[] = "cannot execute the program\n";
    [[maybe_unused]] auto ignored = ::write(STDERR_FILENO, message, sizeof(message) - 1);
    ::_exit(127);
  }
  return pid;
}

void WriteAllAndClose(int fd, const std::string& text) {
  for (size_t written = 0; written < text.size();) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  ::close(fd);
}

Result<CommandOutcome> RunCapturing(const std::vector<std::string>& argv, const std::string& input,
                                    int timeout_ms) {
  int in_pipe[2], out_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0) return Unavailable("pipe: {}", std::strerror(errno));
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    return Unavailable("pipe: {}", std::strerror(errno));
  }
  Result<pid_t> pid = Spawn(argv, in_pipe[0], out_pipe[1], /*new_session=*/false);
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  if (!pid.ok()) {
    ::close(in_pipe[1]);
    ::close(out_pipe[0]);
    return pid.status();
  }
  // The input is small (a token): it fits the pipe, so writing it first cannot block for long.
  // A child that does not read it gets EPIPE here, which is not an error of ours.
  WriteAllAndClose(in_pipe[1], input);
  CommandOutcome outcome;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool timed_out = false;
  char buffer[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd fd{out_pipe[0], POLLIN, 0};
    const int ready = ::poll(&fd, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    const ssize_t n = ::read(out_pipe[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: every writer closed
    outcome.output.append(buffer, static_cast<size_t>(n));
  }
  ::close(out_pipe[0]);
  if (timed_out) ::kill(-*pid, SIGKILL);
  int status = 0;
  while (::waitpid(*pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    return TimedOut("`{}` ran past {} ms and was killed; its output: {}", argv[0], timeout_ms,
                    Tail(outcome.output));
  }
  outcome.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return outcome;
}

Result<CommandOutcome> SshShell::Run(const std::string& host, const std::string& user,
                                     const std::string& command, const std::string& input,
                                     int timeout_ms) {
  if (IsLoopbackHost(host)) return RunCapturing({"/bin/sh", "-c", command}, input, timeout_ms);
  Result<CommandOutcome> outcome =
      RunCapturing(SshArgv(options_, host, user, command), input, timeout_ms);
  if (!outcome.ok()) return outcome.status().WithContext("ssh " + host);
  if (outcome->exit_code == 255) {
    return Unavailable("ssh cannot reach {}: {}", host, Tail(outcome->output));
  }
  if (outcome->exit_code == 127 && outcome->output.find("cannot execute") == 0) {
    return Unavailable("cannot run '{}' (is OpenSSH's client installed?)", options_.ssh_binary);
  }
  return outcome;
}

Result<std::map<std::string, int>> SchedulerProbe::AliveWorkers(
    const std::string& address, const std::string& token, const std::vector<std::string>& nodes) {
  ConnectOptions connect;
  connect.token = token;
  connect.admin = true;
  connect.timeout_ms = 3000;
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Cluster> cluster, Cluster::Connect(address, connect));
  TESSERA_ASSIGN_OR_RETURN(ClusterInfo info, cluster->Info());
  std::map<std::string, std::string> node_of_host;  // advertised host -> node address
  std::map<std::string, int> alive;
  for (const std::string& node : nodes) {
    alive[node] = 0;
    node_of_host.emplace(node, node);
    node_of_host.emplace(ResolveIpv4(node), node);
  }
  for (const WorkerInfo& worker : info.workers) {
    if (!worker.alive) continue;
    const std::string host = worker.data_address.substr(0, worker.data_address.rfind(':'));
    if (auto it = node_of_host.find(host); it != node_of_host.end()) ++alive[it->second];
  }
  return alive;
}

}  // namespace tessera::launcher
