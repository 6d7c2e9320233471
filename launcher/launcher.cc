#include "launcher/launcher.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"

namespace tessera::launcher {
namespace {

class SteadyClock final : public LauncherClock {
 public:
  int64_t NowMs() override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void SleepMs(int64_t ms) override { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
};

// "exit 3: <tail of output>", or "killed by signal 9" for 128+N.
std::string DescribeOutcome(const CommandOutcome& outcome) {
  std::string how = outcome.exit_code > 128
                        ? fmt::format("killed by signal {}", outcome.exit_code - 128)
                        : fmt::format("exit status {}", outcome.exit_code);
  const std::string tail = Tail(outcome.output);
  return tail.empty() ? how : how + ": " + tail;
}

// Where FindTesseraScript leaves the program.
constexpr const char* kTessera = "\"$TESSERA_PROGRAM\"";

// A pgrep/pkill pattern for the processes whose command line names `dir`, which does not match
// the shell running it: its first character is written as a bracket expression, so the
// pattern's own text ("[/]tmp/...") never contains what it matches ("/tmp/...").
std::string ProcessPattern(const std::string& dir) {
  return dir.empty() ? std::string() : "[" + dir.substr(0, 1) + "]" + dir.substr(1) + "/";
}

}  // namespace

std::unique_ptr<LauncherClock> MakeSteadyClock() { return std::make_unique<SteadyClock>(); }

std::string ShellQuote(const std::string& word) {
  std::string quoted = "'";
  for (char c : word) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

std::string FindTesseraScript(const std::string& named, const std::string& own) {
  if (!named.empty()) return "TESSERA_PROGRAM=" + ShellQuote(named) + "; ";
  const std::string where = own.empty() ? std::string("tessera: not found on PATH on ")
                                        : "tessera: not found at " + own +
                                              " (where `tessera up` runs from) nor on PATH on ";
  const std::string fix =
      "; install it there, or name it with tessera_binary in the cluster file or "
      "--tessera-binary";
  std::string script;
  if (!own.empty()) {
    script = "TESSERA_PROGRAM=" + ShellQuote(own) + "; [ -x \"$TESSERA_PROGRAM\" ] || ";
  }
  return script + "TESSERA_PROGRAM=$(command -v tessera) || { echo " + ShellQuote(where) +
         "\"$(hostname)\"" + ShellQuote(fix) + " >&2; exit 127; }; ";
}

std::string Tail(const std::string& text, size_t max_chars) {
  size_t end = text.find_last_not_of(" \t\r\n");
  if (end == std::string::npos) return std::string();
  std::string tail = text.substr(0, end + 1);
  if (tail.size() > max_chars) tail = "..." + tail.substr(tail.size() - max_chars);
  std::string out;
  for (char c : tail) {
    if (c == '\n') {
      out += " | ";
    } else if (c != '\r') {
      out += c;
    }
  }
  return out;
}

bool LaunchReport::ok() const {
  return std::all_of(hosts.begin(), hosts.end(), [](const HostReport& h) { return h.ok; });
}

std::string LaunchReport::Table() const {
  std::string table = fmt::format("{:<24} {:<5} {:>8}  {}\n", "host", "role", "workers", "status");
  for (const HostReport& h : hosts) {
    const std::string workers = h.role == "head" || h.expected == 0
                                    ? std::string("-")
                                    : fmt::format("{}/{}", h.joined, h.expected);
    table += fmt::format("{:<24} {:<5} {:>8}  {}{}\n", h.host, h.role, workers,
                         h.ok ? "ok" : "FAILED", h.detail.empty() ? "" : ": " + h.detail);
  }
  return table;
}

Launcher::Launcher(ClusterSpec spec, LauncherOptions options, RemoteShell& shell,
                   ClusterProbe& probe, LauncherClock& clock)
    : spec_(std::move(spec)),
      options_(std::move(options)),
      shell_(shell),
      probe_(probe),
      clock_(clock) {}

std::string Launcher::StatePath() const { return options_.state_dir + "/" + spec_.name + ".json"; }
std::string Launcher::TokenPath() const { return options_.state_dir + "/" + spec_.name + ".token"; }

Result<ClusterState> Launcher::ReadState() const {
  Result<std::string> text = ReadFileTrimmed(StatePath());
  if (!text.ok())
    return NotFound("no cluster '{}' was started from here ({} is missing)", spec_.name,
                    StatePath());
  const nlohmann::json json = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("address") || !json["address"].is_string() ||
      !json.contains("head_session_dir") || !json["head_session_dir"].is_string()) {
    return DataLoss("the state file {} is damaged; remove it (and stop the cluster by hand)",
                    StatePath());
  }
  ClusterState state{json["address"].get<std::string>(),
                     json["head_session_dir"].get<std::string>(), ""};
  // Absent in the state of a cluster started by an older launcher.
  if (json.contains("dashboard") && json["dashboard"].is_string()) {
    state.dashboard = json["dashboard"].get<std::string>();
  }
  return state;
}

std::string Launcher::FindTessera() const {
  return FindTesseraScript(spec_.tessera_binary, options_.launcher_binary);
}

std::string Launcher::Environment(const EnvironmentMap& extra) const {
  EnvironmentMap merged = spec_.env;
  for (const auto& [name, value] : extra) merged[name] = value;
  std::string exports;
  for (const auto& [name, value] : merged) {
    exports += "export " + name + "=" + ShellQuote(value) + "; ";
  }
  return exports;
}

Result<CommandOutcome> Launcher::Setup(const std::string& host, const std::string& user,
                                       const EnvironmentMap& extra) {
  if (spec_.setup_commands.empty()) return CommandOutcome{};
  std::string script = Environment(extra) + "set -e; ";
  for (const std::string& command : spec_.setup_commands) script += command + "\n";
  return shell_.Run(host, user, script, "", static_cast<int>(options_.command_timeout_ms));
}

Result<CommandOutcome> Launcher::StartProcesses(const std::string& host, const std::string& user,
                                                const std::string& start,
                                                const std::string& input) {
  const int timeout_ms = static_cast<int>(options_.command_timeout_ms);
  if (!shell_.StartsBlock()) return shell_.Run(host, user, start, input, timeout_ms);
  return shell_.StartBlocking(host, user, start + " --block", input, timeout_ms);
}

Result<std::string> Launcher::StartHead(ClusterState& state) {
  const std::string& host = spec_.head.address;
  Result<CommandOutcome> setup = Setup(host, spec_.ssh.user, {});
  if (!setup.ok()) return setup.status().WithContext("running the setup commands on the head");
  if (setup->exit_code != 0) {
    return Unavailable("the setup commands failed on the head {} ({})", host,
                       DescribeOutcome(*setup));
  }
  state.address = fmt::format("{}:{}", host, spec_.head.port);
  state.head_session_dir = spec_.HeadSessionDir();
  const std::string start =
      Environment({}) + FindTessera() + "mkdir -p " + ShellQuote(spec_.session_root) + " && " +
      kTessera + " start --head --host " + ShellQuote(host) + " --port " +
      std::to_string(spec_.head.port) + " --session-dir " + ShellQuote(state.head_session_dir);
  Result<CommandOutcome> started = StartProcesses(host, spec_.ssh.user, start, "");
  if (!started.ok()) return started.status().WithContext("starting the head");
  if (started->exit_code != 0) {
    return Unavailable("`tessera start --head` failed on {} ({})", host, DescribeOutcome(*started));
  }
  Result<CommandOutcome> token =
      shell_.Run(host, spec_.ssh.user, "cat " + ShellQuote(state.head_session_dir + "/token"), "",
                 static_cast<int>(options_.command_timeout_ms));
  if (!token.ok()) return token.status().WithContext("reading the cluster token on the head");
  const std::string text = Tail(token->output, 4096);
  if (token->exit_code != 0 || text.empty() || text.find(' ') != std::string::npos) {
    return Unavailable("cannot read the cluster token {} on {} ({})",
                       state.head_session_dir + "/token", host, DescribeOutcome(*token));
  }
  // The dashboard's HOST:PORT, written by the scheduler before it answered `start` (none when
  // it serves no dashboard).
  Result<CommandOutcome> dashboard = shell_.Run(
      host, spec_.ssh.user,
      "cat " + ShellQuote(state.head_session_dir + "/dashboard.address") + " 2>/dev/null || true",
      "", static_cast<int>(options_.command_timeout_ms));
  if (dashboard.ok() && dashboard->exit_code == 0) {
    state.dashboard = Tail(dashboard->output, 256);
    if (state.dashboard.find_first_of(" |") != std::string::npos) state.dashboard.clear();
  }
  std::error_code error;
  std::filesystem::create_directories(options_.state_dir, error);
  ::chmod(options_.state_dir.c_str(), 0700);
  TESSERA_RETURN_IF_ERROR(WriteFileAtomically(TokenPath(), text + "\n", 0600));
  const nlohmann::json json = {{"cluster_name", spec_.name},
                               {"file", spec_.file},
                               {"address", state.address},
                               {"head", host},
                               {"head_session_dir", state.head_session_dir},
                               {"dashboard", state.dashboard}};
  TESSERA_RETURN_IF_ERROR(WriteFileAtomically(StatePath(), json.dump(2) + "\n", 0600));
  return text;
}

HostReport Launcher::StartNode(const NodeSpec& node, int missing, const std::string& address,
                               const std::string& token) {
  HostReport report{node.address, "node", node.workers + node.gpus, 0, false, ""};
  const std::string user = node.user.empty() ? spec_.ssh.user : node.user;
  const auto fail = [&report](std::string why) {
    report.detail = std::move(why);
    return report;
  };
  Result<CommandOutcome> setup = Setup(node.address, user, node.env);
  if (!setup.ok()) return fail(setup.status().message());
  if (setup->exit_code != 0) {
    return fail("setup commands failed (" + DescribeOutcome(*setup) + ")");
  }
  const std::string dir = spec_.NodeSessionDir(node);
  const std::string token_file = dir + "/token";
  std::string command = Environment(node.env) + FindTessera() + "umask 077 && mkdir -p " +
                        ShellQuote(dir) + " && cat > " + ShellQuote(token_file) + " && " +
                        kTessera + " start --address " + ShellQuote(address) + " --token-file " +
                        ShellQuote(token_file);
  std::vector<std::string> starts;
  if (missing > 0) {
    starts.push_back(command + " --cpu-workers " + std::to_string(missing) + " --threads " +
                     std::to_string(node.threads) + " --host-memory-mb " +
                     std::to_string(node.host_memory_mb));
  }
  if (node.gpus > 0) {  // one GPU worker on each of the node's first `gpus` GPUs
    std::string list = "0";
    for (int gpu = 1; gpu < node.gpus; ++gpu) list += "," + std::to_string(gpu);
    starts.push_back(command + " --gpus " + list + " --threads " + std::to_string(node.threads) +
                     " --host-memory-mb " + std::to_string(node.host_memory_mb));
  }
  for (const std::string& start : starts) {
    Result<CommandOutcome> outcome = StartProcesses(node.address, user, start, token + "\n");
    if (!outcome.ok()) return fail(outcome.status().message());
    if (outcome->exit_code != 0) {
      return fail("`tessera start` failed (" + DescribeOutcome(*outcome) + ")");
    }
  }
  report.ok = true;
  report.detail = fmt::format("started {}", missing);
  return report;
}

Result<LaunchReport> Launcher::Up() {
  std::vector<std::string> addresses;
  addresses.reserve(spec_.nodes.size());
  for (const NodeSpec& node : spec_.nodes) addresses.push_back(node.address);
  LaunchReport report;
  HostReport head{spec_.head.address, "head", 0, 0, true, ""};
  ClusterState state;
  std::string token;
  Result<ClusterState> previous = ReadState();
  Result<std::string> previous_token = ReadFileTrimmed(TokenPath());
  if (previous.ok() && previous_token.ok() &&
      probe_.AliveWorkers(previous->address, *previous_token, addresses).ok()) {
    state = *previous;
    token = *previous_token;
    head.detail = "running, kept";
  } else {
    TESSERA_ASSIGN_OR_RETURN(token, StartHead(state));
    head.detail = "started";
  }
  report.address = state.address;
  report.token_file = TokenPath();
  report.dashboard = state.dashboard;
  report.hosts.push_back(head);

  // The head answered `start` only once it listened, but give a restarted one a moment.
  Result<std::map<std::string, int>> alive = probe_.AliveWorkers(state.address, token, addresses);
  for (int attempt = 0; !alive.ok() && attempt < 20; ++attempt) {
    clock_.SleepMs(options_.poll_ms);
    alive = probe_.AliveWorkers(state.address, token, addresses);
  }
  if (!alive.ok()) return alive.status().WithContext("the head started but does not answer");

  std::vector<HostReport> nodes(spec_.nodes.size());
  std::vector<std::thread> starting;
  for (size_t i = 0; i < spec_.nodes.size(); ++i) {
    const NodeSpec& node = spec_.nodes[i];
    const int running = (*alive)[node.address];
    const int missing = std::max(0, node.workers - running);
    if (missing == 0 && running >= node.workers + node.gpus) {
      nodes[i] = HostReport{node.address, "node", node.workers + node.gpus,
                            running,      true,   "running, kept"};
      continue;
    }
    starting.emplace_back([this, &nodes, i, missing, &state, &token] {
      nodes[i] = StartNode(spec_.nodes[i], missing, state.address, token);
    });
  }
  for (std::thread& thread : starting) thread.join();

  // Wait for every started node's workers (`tessera start` returns once they joined, so this
  // normally passes at once; it also catches workers that died right after joining).
  const int64_t deadline = clock_.NowMs() + int64_t{spec_.join_timeout_s} * 1000;
  while (true) {
    alive = probe_.AliveWorkers(state.address, token, addresses);
    bool complete = alive.ok();
    for (HostReport& node : nodes) {
      if (alive.ok()) node.joined = (*alive)[node.host];
      if (node.ok && node.joined < node.expected) complete = false;
    }
    if (complete || clock_.NowMs() >= deadline) break;
    clock_.SleepMs(options_.poll_ms);
  }
  for (HostReport& node : nodes) {
    if (!alive.ok()) {
      node.ok = false;
      node.detail = alive.status().message();
    } else if (node.ok && node.joined < node.expected) {
      node.ok = false;
      node.detail += fmt::format("; only {} of {} workers joined within {} s", node.joined,
                                 node.expected, spec_.join_timeout_s);
    }
    report.hosts.push_back(node);
  }
  return report;
}

HostReport Launcher::StopHost(const std::string& host, const std::string& user,
                              const std::string& session_dir, const std::string& role) {
  HostReport report{host, role, 0, 0, false, ""};
  const int polls = static_cast<int>(std::max<int64_t>(1, options_.stop_grace_ms / 100));
  const std::string script =
      "p=" + ShellQuote(ProcessPattern(session_dir)) +
      "; pkill -TERM -f \"$p\"; i=0; while [ $i -lt " + std::to_string(polls) +
      " ] && pgrep -f \"$p\" >/dev/null; do sleep 0.1; i=$((i+1)); done; "
      "if pgrep -f \"$p\" >/dev/null; then pkill -KILL -f \"$p\"; sleep 0.5; "
      "echo 'killed (SIGKILL) what did not stop within the grace period'; fi; "
      "if pgrep -a -f \"$p\"; then exit 3; fi; exit 0";
  Result<CommandOutcome> outcome =
      shell_.Run(host, user, script, "", static_cast<int>(options_.command_timeout_ms));
  if (!outcome.ok()) {
    report.detail = outcome.status().message();
  } else if (outcome->exit_code == 3) {
    report.detail = "processes still running: " + Tail(outcome->output);
  } else if (outcome->exit_code != 0) {
    report.detail = "the stop script failed (" + DescribeOutcome(*outcome) + ")";
  } else {
    report.ok = true;
    report.detail =
        outcome->output.empty() ? "no process left" : Tail(outcome->output) + "; no process left";
  }
  return report;
}

Result<LaunchReport> Launcher::Down() {
  LaunchReport report;
  report.token_file = TokenPath();
  Result<ClusterState> state = ReadState();
  std::string head_note;
  if (state.ok()) {
    report.address = state->address;
    // Ask the scheduler to stop everything first: workers leave cleanly.
    const std::string stop = Environment({}) + FindTessera() + kTessera + " stop --address " +
                             ShellQuote(state->address) + " --token-file " +
                             ShellQuote(state->head_session_dir + "/token");
    Result<CommandOutcome> stopped = shell_.Run(spec_.head.address, spec_.ssh.user, stop, "",
                                                static_cast<int>(options_.command_timeout_ms));
    head_note = !stopped.ok()             ? stopped.status().message()
                : stopped->exit_code == 0 ? std::string("scheduler stopped")
                                          : "`tessera stop`: " + DescribeOutcome(*stopped);
  }
  std::vector<HostReport> hosts(spec_.nodes.size() + 1);
  std::vector<std::thread> stopping;
  stopping.emplace_back([&] {
    hosts[0] = StopHost(spec_.head.address, spec_.ssh.user, spec_.HeadSessionDir(), "head");
    if (!head_note.empty()) hosts[0].detail = head_note + "; " + hosts[0].detail;
  });
  for (size_t i = 0; i < spec_.nodes.size(); ++i) {
    stopping.emplace_back([this, &hosts, i] {
      const NodeSpec& node = spec_.nodes[i];
      hosts[i + 1] = StopHost(node.address, node.user.empty() ? spec_.ssh.user : node.user,
                              spec_.NodeSessionDir(node), "node");
    });
  }
  for (std::thread& thread : stopping) thread.join();
  report.hosts = std::move(hosts);
  if (report.ok()) {
    std::error_code ignored;
    std::filesystem::remove(StatePath(), ignored);
    std::filesystem::remove(TokenPath(), ignored);
  }
  return report;
}

Result<LaunchReport> Launcher::Attach() {
  TESSERA_ASSIGN_OR_RETURN(ClusterState state, ReadState());
  TESSERA_ASSIGN_OR_RETURN(std::string token, ReadFileTrimmed(TokenPath()));
  std::vector<std::string> addresses;
  addresses.reserve(spec_.nodes.size());
  for (const NodeSpec& node : spec_.nodes) addresses.push_back(node.address);
  Result<std::map<std::string, int>> alive = probe_.AliveWorkers(state.address, token, addresses);
  if (!alive.ok()) {
    return alive.status().WithContext(
        fmt::format("cluster '{}' (state {}) is not answering", spec_.name, StatePath()));
  }
  LaunchReport report;
  report.address = state.address;
  report.token_file = TokenPath();
  report.dashboard = state.dashboard;
  report.hosts.push_back({spec_.head.address, "head", 0, 0, true, "running"});
  for (const NodeSpec& node : spec_.nodes) {
    const int joined = (*alive)[node.address];
    const int expected = node.workers + node.gpus;
    report.hosts.push_back({node.address, "node", expected, joined, joined >= expected,
                            joined >= expected ? "" : "workers missing: run `tessera up` again"});
  }
  return report;
}

}  // namespace tessera::launcher
