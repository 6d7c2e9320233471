#include "launcher/slurm.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "core/atomic_file.h"
#include "launcher/ssh_shell.h"

namespace tessera::launcher {

namespace {

constexpr size_t kMaxHosts = 65536;

// The items of `text` between commas ("" is one empty item).
std::vector<std::string_view> CommaItems(std::string_view text) {
  std::vector<std::string_view> items;
  size_t begin = 0;
  while (true) {
    const size_t end = std::min(text.find(',', begin), text.size());
    items.push_back(text.substr(begin, end - begin));
    if (end == text.size()) return items;
    begin = end + 1;
  }
}

// `text`, all of it, as a number of at most 9 digits (from_chars: no sign for unsigned types).
template <typename T>
bool ParseWhole(std::string_view text, T& value) {
  if (text.empty() || text.size() > 9) return false;
  const auto [rest, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return error == std::errc() && rest == text.data() + text.size();
}

// "[lo-hi,n,...]"'s inside: each number with its zero padding, in order.
Status ExpandRanges(std::string_view list, std::string_view ranges, std::vector<std::string>& out) {
  for (std::string_view item : CommaItems(ranges)) {
    const size_t dash = item.find('-');
    const std::string_view low = item.substr(0, dash);
    const std::string_view high = dash == std::string_view::npos ? low : item.substr(dash + 1);
    uint64_t from = 0, to = 0;
    if (!ParseWhole(low, from) || !ParseWhole(high, to) || to < from) {
      return InvalidArgument("hostlist '{}': '{}' is not a number or a range lo-hi of numbers",
                             list, item);
    }
    if (out.size() + (to - from + 1) > kMaxHosts) {
      return InvalidArgument("hostlist '{}' names more than {} hosts", list, kMaxHosts);
    }
    for (uint64_t value = from; value <= to; ++value) {
      std::string number = std::to_string(value);
      if (number.size() < low.size()) number.insert(0, low.size() - number.size(), '0');
      out.push_back(std::move(number));
    }
  }
  return Status::Ok();
}

// One item of a hostlist, with any number of bracketed groups.
Status ExpandItem(std::string_view list, std::string_view item, std::vector<std::string>& out) {
  const size_t open = item.find('[');
  if (open == std::string_view::npos) {
    if (item.find(']') != std::string_view::npos) {
      return InvalidArgument("hostlist '{}': ']' without '[' in '{}'", list, item);
    }
    out.emplace_back(item);
    return Status::Ok();
  }
  const size_t close = item.find(']', open);
  if (close == std::string_view::npos) {
    return InvalidArgument("hostlist '{}': '[' without ']' in '{}'", list, item);
  }
  std::vector<std::string> numbers;
  TESSERA_RETURN_IF_ERROR(ExpandRanges(list, item.substr(open + 1, close - open - 1), numbers));
  std::vector<std::string> rests;
  TESSERA_RETURN_IF_ERROR(ExpandItem(list, item.substr(close + 1), rests));
  if (out.size() + numbers.size() * rests.size() > kMaxHosts) {
    return InvalidArgument("hostlist '{}' names more than {} hosts", list, kMaxHosts);
  }
  const std::string_view prefix = item.substr(0, open);
  for (const std::string& number : numbers) {
    for (const std::string& rest : rests) {
      std::string host(prefix);
      host += number;
      host += rest;
      out.push_back(std::move(host));
    }
  }
  return Status::Ok();
}

std::string ReadLog(const std::string& path) {
  Result<std::string> text = ReadWholeFile(path, "srun log");
  return text.ok() ? *text : std::string();
}

}  // namespace

Result<std::vector<std::string>> ExpandHostlist(std::string_view hostlist) {
  std::vector<std::string> hosts;
  size_t begin = 0;
  int depth = 0;
  for (size_t i = 0; i <= hostlist.size(); ++i) {
    if (i < hostlist.size() && hostlist[i] == '[') ++depth;
    if (i < hostlist.size() && hostlist[i] == ']') --depth;
    if (i < hostlist.size() && (hostlist[i] != ',' || depth > 0)) continue;
    const std::string_view item = hostlist.substr(begin, i - begin);
    if (item.empty()) {
      return InvalidArgument("hostlist '{}' has an empty item (two commas, or one at an end)",
                             hostlist);
    }
    TESSERA_RETURN_IF_ERROR(ExpandItem(hostlist, item, hosts));
    begin = i + 1;
  }
  return hosts;
}

Result<std::vector<int>> ExpandCpusPerNode(std::string_view spec, size_t nodes) {
  std::vector<int> cpus;
  for (std::string_view item : CommaItems(spec)) {
    const size_t paren = item.find("(x");
    int value = 0, repeat = 1;
    bool ok = ParseWhole(item.substr(0, paren), value) && value > 0;
    if (ok && paren != std::string_view::npos) {
      const std::string_view times = item.substr(paren + 2);
      ok = times.ends_with(')') && ParseWhole(times.substr(0, times.size() - 1), repeat) &&
           repeat > 0 && static_cast<size_t>(repeat) <= nodes;
    }
    if (!ok) {
      return InvalidArgument("SLURM_JOB_CPUS_PER_NODE '{}': '{}' is not N or N(xK)", spec, item);
    }
    cpus.insert(cpus.end(), static_cast<size_t>(repeat), value);
    if (cpus.size() > nodes) break;
  }
  if (cpus.size() != nodes) {
    return InvalidArgument("SLURM_JOB_CPUS_PER_NODE '{}' describes {} nodes, the allocation has {}",
                           spec, cpus.size(), nodes);
  }
  return cpus;
}

Result<SlurmAllocation> SlurmAllocationFromEnvironment(
    const std::function<std::optional<std::string>(const char*)>& getenv) {
  auto first = [&](const char* a, const char* b) -> std::optional<std::string> {
    if (std::optional<std::string> value = getenv(a); value && !value->empty()) return value;
    return getenv(b);
  };
  const std::optional<std::string> nodelist = first("SLURM_JOB_NODELIST", "SLURM_NODELIST");
  const std::optional<std::string> job = first("SLURM_JOB_ID", "SLURM_JOBID");
  if (!nodelist || nodelist->empty() || !job || job->empty()) {
    return InvalidArgument(
        "tessera up --slurm runs inside a Slurm allocation, and SLURM_JOB_NODELIST or "
        "SLURM_JOB_ID is not set: run it in `salloc -N <nodes>` or in an sbatch script (or use a "
        "cluster file without --slurm)");
  }
  SlurmAllocation allocation;
  allocation.job_id = *job;
  TESSERA_ASSIGN_OR_RETURN(allocation.nodes, ExpandHostlist(*nodelist));
  if (std::optional<std::string> cpus = getenv("SLURM_JOB_CPUS_PER_NODE"); cpus && !cpus->empty()) {
    TESSERA_ASSIGN_OR_RETURN(allocation.cpus, ExpandCpusPerNode(*cpus, allocation.nodes.size()));
  }
  return allocation;
}

ClusterSpec SlurmClusterSpec(const SlurmAllocation& allocation,
                             const SlurmClusterOptions& options) {
  ClusterSpec spec;
  spec.name = "slurm-" + allocation.job_id;
  spec.file = "the Slurm allocation " + allocation.job_id;
  spec.head = HeadSpec{allocation.nodes.front(), options.port};
  if (!options.session_root.empty()) spec.session_root = options.session_root;
  spec.join_timeout_s = options.join_timeout_s;
  for (size_t i = 0; i < allocation.nodes.size(); ++i) {
    NodeSpec node;
    node.address = allocation.nodes[i];
    node.workers = options.workers_per_node;
    node.threads = options.threads;
    if (node.threads == 0 && i < allocation.cpus.size()) {
      node.threads = std::max(1, allocation.cpus[i] / std::max(1, options.workers_per_node));
    }
    node.host_memory_mb = options.host_memory_mb;
    spec.nodes.push_back(std::move(node));
  }
  return spec;
}

std::vector<std::string> SrunArgv(const std::string& srun_binary, const std::string& host,
                                  const std::string& command) {
  // --overlap: beside the other steps (every node runs several); --mem=0: the job's memory on the
  // node, where memory is a consumable; --kill-on-bad-exit=0: one failing command ends no other.
  return {srun_binary,
          "--overlap",
          "--nodes=1",
          "--ntasks=1",
          "--nodelist=" + host,
          "--mem=0",
          "--kill-on-bad-exit=0",
          "--job-name=tessera",
          "/bin/sh",
          "-c",
          command};
}

Result<CommandOutcome> SrunShell::Run(const std::string& host, const std::string& /*user*/,
                                      const std::string& command, const std::string& input,
                                      int timeout_ms) {
  Result<CommandOutcome> outcome =
      RunCapturing(SrunArgv(options_.srun_binary, host, command), input, timeout_ms);
  if (!outcome.ok()) return outcome.status().WithContext("srun on " + host);
  if (outcome->exit_code == 127 && outcome->output.find("cannot execute") == 0) {
    return Unavailable(
        "cannot run '{}' (is Slurm's client installed, and this inside an "
        "allocation?)",
        options_.srun_binary);
  }
  if (outcome->exit_code != 0 && outcome->output.find("srun: error") != std::string::npos) {
    return Unavailable("srun cannot run a step on {}: {}", host, Tail(outcome->output));
  }
  return outcome;
}

Result<CommandOutcome> SrunShell::StartBlocking(const std::string& host,
                                                const std::string& /*user*/,
                                                const std::string& command,
                                                const std::string& input, int timeout_ms) {
  static std::atomic<int> next{0};
  const std::string log =
      fmt::format("{}/{}-{}-{}.log", options_.log_dir, host, ::getpid(), next++);
  const int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (log_fd < 0) return Unavailable("cannot create {}: {}", log, std::strerror(errno));
  int in_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0) {
    ::close(log_fd);
    return Unavailable("pipe: {}", std::strerror(errno));
  }
  // A session of its own: it outlives `tessera up`, and no terminal's signals reach it.
  Result<pid_t> spawned = Spawn(SrunArgv(options_.srun_binary, host, command), in_pipe[0], log_fd,
                                /*new_session=*/true);
  ::close(in_pipe[0]);
  ::close(log_fd);
  if (!spawned.ok()) {
    ::close(in_pipe[1]);
    return spawned.status();
  }
  const pid_t pid = *spawned;
  WriteAllAndClose(in_pipe[1], input);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    int status = 0;
    const pid_t ended = ::waitpid(pid, &status, WNOHANG);
    const std::string output = ReadLog(log);
    if (output.find(kBlockingStartedLine) != std::string::npos) {
      return CommandOutcome{0, output};  // up; the step stays
    }
    if (ended == pid) {
      CommandOutcome outcome{WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status),
                             output};
      if (outcome.exit_code == 127 && output.find("cannot execute") == 0) {
        return Unavailable("cannot run '{}' (is Slurm's client installed?)", options_.srun_binary);
      }
      if (outcome.exit_code != 0 && output.find("srun: error") != std::string::npos) {
        return Unavailable("srun cannot run a step on {}: {}", host, Tail(output));
      }
      return outcome;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(-pid, SIGTERM);
      std::this_thread::sleep_for(std::chrono::seconds(1));
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return TimedOut(
          "the srun step on {} did not say its processes were up within {} ms and was "
          "killed; its output ({}): {}",
          host, timeout_ms, log, Tail(output));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace tessera::launcher
