// The launcher's orchestration (launcher/launcher.h) over a scripted shell, scheduler and clock:
// what `up` starts and where, that it is idempotent, how failures are reported, and what `down`
// runs. launcher_cli_test and multinode_test run the real thing.
#include "launcher/launcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <set>

#include "core/atomic_file.h"
#include "launcher/slurm.h"
#include "launcher/ssh_shell.h"
#include "test_util.h"

namespace tessera::launcher {
namespace {

struct Call {
  std::string host, user, command, input;
};

// A cluster simulated in memory: the shell "starts" the head and workers by updating it, the
// probe reads it.
class FakeCluster final : public RemoteShell, public ClusterProbe, public LauncherClock {
 public:
  Result<CommandOutcome> Run(const std::string& host, const std::string& user,
                             const std::string& command, const std::string& input,
                             int /*timeout_ms*/) override {
    std::lock_guard lock(mutex_);
    calls.push_back({host, user, command, input});
    if (unreachable.count(host)) return Unavailable("ssh cannot reach {}: No route to host", host);
    if (command.find("set -e") != std::string::npos && failing_setup.count(host)) {
      return CommandOutcome{2, "mkdir: cannot create directory '/data': Permission denied\n"};
    }
    if (command.find("start --head") != std::string::npos) {
      head_running = true;
      token = "t0k3n";
      return CommandOutcome{0, "Tessera scheduler started\n"};
    }
    if (command.starts_with("cat ") && command.find("dashboard.address") != std::string::npos) {
      return CommandOutcome{0, dashboard.empty() ? "" : dashboard + "\n"};
    }
    if (command.starts_with("cat ")) return CommandOutcome{0, token + "\n"};
    if (command.find("--cpu-workers") != std::string::npos) {
      if (input != token + "\n") return CommandOutcome{1, "invalid cluster token\n"};
      if (broken_binary.count(host)) return CommandOutcome{127, "sh: tessera: not found\n"};
      const size_t at = command.find("--cpu-workers ") + 14;
      if (!silent.count(host)) alive[host] += std::stoi(command.substr(at));
      return CommandOutcome{0, "joined\n"};
    }
    if (command.find("--gpus ") != std::string::npos) {  // one GPU worker per listed GPU
      if (input != token + "\n") return CommandOutcome{1, "invalid cluster token\n"};
      const size_t at = command.find("--gpus ") + 7;
      const std::string list = command.substr(at, command.find(' ', at) - at);
      alive[host] += 1 + static_cast<int>(std::count(list.begin(), list.end(), ','));
      return CommandOutcome{0, "joined\n"};
    }
    if (command.find(" stop --address") != std::string::npos) {
      head_running = false;
      alive.clear();
      return CommandOutcome{0, "stopped\n"};
    }
    if (command.find("pkill") != std::string::npos) {
      if (stuck.count(host)) return CommandOutcome{3, "4242 tessera worker ...\n"};
      return CommandOutcome{0, ""};
    }
    return CommandOutcome{0, ""};
  }

  // As srun's shell (blocks): `tessera start` runs with --block through StartBlocking.
  bool StartsBlock() const override { return blocks; }
  Result<CommandOutcome> StartBlocking(const std::string& host, const std::string& user,
                                       const std::string& command, const std::string& input,
                                       int timeout_ms) override {
    {
      std::lock_guard lock(mutex_);
      blocking.push_back({host, user, command, input});
    }
    return Run(host, user, command, input, timeout_ms);
  }

  Result<std::map<std::string, int>> AliveWorkers(const std::string& address,
                                                  const std::string& given_token,
                                                  const std::vector<std::string>& nodes) override {
    std::lock_guard lock(mutex_);
    ++probes;
    if (!head_running) return Unavailable("nothing answers at {}", address);
    if (given_token != token) return Unavailable("invalid cluster token");
    std::map<std::string, int> out;
    for (const std::string& node : nodes) out[node] = alive.count(node) ? alive.at(node) : 0;
    return out;
  }

  int64_t NowMs() override { return now_ms; }
  void SleepMs(int64_t ms) override { now_ms += ms; }

  // Calls whose command contains `text`.
  std::vector<Call> CallsWith(const std::string& text) const {
    std::vector<Call> out;
    for (const Call& call : calls) {
      if (call.command.find(text) != std::string::npos) out.push_back(call);
    }
    return out;
  }

  std::mutex mutex_;
  std::vector<Call> calls;
  bool blocks = false;
  std::vector<Call> blocking;  // the StartBlocking calls (also in `calls`)
  bool head_running = false;
  std::string token;
  std::string dashboard = "10.0.0.1:8265";  // what the head's dashboard.address holds
  std::map<std::string, int> alive;
  std::set<std::string> unreachable, failing_setup, broken_binary, silent, stuck;
  int probes = 0;
  int64_t now_ms = 0;
};

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_dir_ = testing::TempPath("launcher_test_state");
    std::filesystem::remove_all(state_dir_);
    Result<ClusterSpec> spec = ParseClusterYaml(R"(cluster_name: three
head: {address: 10.0.0.1, port: 7000}
nodes:
  - {address: 10.0.0.1, workers: 1}
  - {address: 10.0.0.2, workers: 2, user: bob, env: {A: "x y"}}
  - {address: 10.0.0.3, workers: 1}
ssh: {user: root}
setup_commands: ["mkdir -p /data"]
env: {TESSERA_LOG_LEVEL: warn}
tessera_binary: /opt/bin/tessera
join_timeout_s: 5
)",
                                                "three.yaml");
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    spec_ = *spec;
  }
  Launcher Make() { return Launcher(spec_, {.state_dir = state_dir_}, fake_, fake_, fake_); }

  std::string state_dir_;
  ClusterSpec spec_;
  FakeCluster fake_;
};

TEST_F(LauncherTest, UpStartsHeadThenEveryNodesWorkers) {
  Launcher launcher = Make();
  Result<LaunchReport> report = launcher.Up();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->ok()) << report->Table();
  EXPECT_EQ(report->address, "10.0.0.1:7000");
  ASSERT_EQ(report->hosts.size(), 4u);
  EXPECT_EQ(report->hosts[2].joined, 2);
  EXPECT_EQ(report->hosts[2].expected, 2);

  std::vector<Call> head = fake_.CallsWith("start --head");
  ASSERT_EQ(head.size(), 1u);
  EXPECT_EQ(head[0].host, "10.0.0.1");
  EXPECT_NE(head[0].command.find("TESSERA_PROGRAM='/opt/bin/tessera'; "), std::string::npos)
      << head[0].command;
  EXPECT_NE(head[0].command.find("\"$TESSERA_PROGRAM\" start --head --host '10.0.0.1' --port 7000 "
                                 "--session-dir '/tmp/tessera/three-head'"),
            std::string::npos)
      << head[0].command;
  EXPECT_NE(head[0].command.find("export TESSERA_LOG_LEVEL='warn';"), std::string::npos);

  std::vector<Call> workers = fake_.CallsWith("--cpu-workers");
  ASSERT_EQ(workers.size(), 3u);
  for (const Call& call : workers) {
    EXPECT_EQ(call.input, "t0k3n\n");                          // the token on stdin...
    EXPECT_EQ(call.command.find("t0k3n"), std::string::npos);  // ...never on a command line
    EXPECT_NE(call.command.find("--address '10.0.0.1:7000'"), std::string::npos);
    EXPECT_NE(call.command.find("/tmp/tessera/three-node-" + call.host + "/token"),
              std::string::npos);
    if (call.host == "10.0.0.2") {
      EXPECT_EQ(call.user, "bob");
      EXPECT_NE(call.command.find("export A='x y';"), std::string::npos);
      EXPECT_NE(call.command.find("--cpu-workers 2"), std::string::npos);
    } else {
      EXPECT_EQ(call.user, "root");
    }
  }
  EXPECT_EQ(fake_.CallsWith("set -e; mkdir -p /data").size(), 4u);  // head and three nodes
  // The state and the token are kept for down/attach; the token only for this user.
  EXPECT_TRUE(std::filesystem::exists(launcher.StatePath()));
  EXPECT_EQ(ReadFileTrimmed(launcher.TokenPath()).value(), "t0k3n");
  EXPECT_EQ(std::filesystem::status(launcher.TokenPath()).permissions() &
                std::filesystem::perms::group_all,
            std::filesystem::perms::none);
  EXPECT_NE(report->Table().find("10.0.0.2"), std::string::npos);
}

// A node with `gpus: N` gets one GPU worker on each of its first N GPUs, counted like workers.
// A shell whose starts end with their command (srun's: launcher/slurm.h): the head's and the
// nodes' `tessera start` run with --block through StartBlocking; everything else through Run.
TEST_F(LauncherTest, AShellWhoseStartsBlockGetsTesseraStartBlock) {
  fake_.blocks = true;
  Launcher launcher = Make();
  Result<LaunchReport> report = launcher.Up();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->ok()) << report->Table();
  ASSERT_EQ(fake_.blocking.size(), 4u);  // the head, and three nodes' workers
  for (const Call& call : fake_.blocking) {
    EXPECT_NE(call.command.find(" start "), std::string::npos) << call.command;
    EXPECT_TRUE(call.command.ends_with(" --block")) << call.command;
  }
  for (const Call& call : fake_.calls) {
    const bool start = call.command.find(" start --") != std::string::npos;
    EXPECT_EQ(start, call.command.ends_with(" --block")) << call.command;
  }
  EXPECT_EQ(fake_.CallsWith("--block").size(), 4u);
}

TEST_F(LauncherTest, UpStartsAGpuWorkerPerGpuOfANode) {
  Result<ClusterSpec> spec = ParseClusterYaml(R"(cluster_name: gpus
head: {address: 10.0.0.1, port: 7000}
nodes:
  - {address: 10.0.0.1, workers: 1}
  - {address: 10.0.0.2, gpus: 4, threads: 8}
tessera_binary: /opt/bin/tessera
join_timeout_s: 5
)",
                                              "gpus.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  Launcher launcher(*spec, {.state_dir = state_dir_}, fake_, fake_, fake_);
  Result<LaunchReport> report = launcher.Up();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->ok()) << report->Table();
  std::vector<Call> gpu_starts = fake_.CallsWith("--gpus ");
  ASSERT_EQ(gpu_starts.size(), 1u);
  EXPECT_EQ(gpu_starts[0].host, "10.0.0.2");
  EXPECT_NE(gpu_starts[0].command.find("--gpus 0,1,2,3 --threads 8"), std::string::npos)
      << gpu_starts[0].command;
  ASSERT_EQ(report->hosts.size(), 3u);  // the head, then the nodes
  EXPECT_EQ(report->hosts[2].joined, 4);
  EXPECT_EQ(report->hosts[2].expected, 4);
}

TEST_F(LauncherTest, SecondUpChangesNothing) {
  ASSERT_TRUE(Make().Up().ok());
  const size_t calls = fake_.calls.size();
  Result<LaunchReport> again = Make().Up();
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->ok()) << again->Table();
  EXPECT_EQ(fake_.calls.size(), calls) << "a second up ran commands";
  EXPECT_NE(again->Table().find("running, kept"), std::string::npos) << again->Table();
}

TEST_F(LauncherTest, UpStartsOnlyWhatIsMissing) {
  ASSERT_TRUE(Make().Up().ok());
  fake_.alive["10.0.0.2"] = 1;  // one of its two workers died
  fake_.calls.clear();
  Result<LaunchReport> again = Make().Up();
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->ok()) << again->Table();
  std::vector<Call> started = fake_.CallsWith("--cpu-workers");
  ASSERT_EQ(started.size(), 1u);
  EXPECT_EQ(started[0].host, "10.0.0.2");
  EXPECT_NE(started[0].command.find("--cpu-workers 1 "), std::string::npos);
  EXPECT_TRUE(fake_.CallsWith("start --head").empty());
}

TEST_F(LauncherTest, UpRestartsAHeadThatIsGone) {
  ASSERT_TRUE(Make().Up().ok());
  fake_.head_running = false;
  fake_.alive.clear();
  fake_.calls.clear();
  Result<LaunchReport> again = Make().Up();
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->ok()) << again->Table();
  EXPECT_EQ(fake_.CallsWith("start --head").size(), 1u);
  EXPECT_EQ(fake_.CallsWith("--cpu-workers").size(), 3u);
}

TEST_F(LauncherTest, ReportsEachFailingNodeWithItsReason) {
  fake_.unreachable = {"10.0.0.2"};
  fake_.broken_binary = {"10.0.0.3"};
  Result<LaunchReport> report = Make().Up();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_FALSE(report->ok());
  const std::string table = report->Table();
  EXPECT_TRUE(report->hosts[1].ok) << table;
  EXPECT_FALSE(report->hosts[2].ok);
  EXPECT_NE(report->hosts[2].detail.find("ssh cannot reach 10.0.0.2: No route to host"),
            std::string::npos)
      << table;
  EXPECT_FALSE(report->hosts[3].ok);
  EXPECT_NE(report->hosts[3].detail.find("exit status 127: sh: tessera: not found"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("FAILED"), std::string::npos);
}

TEST_F(LauncherTest, ReportsSetupFailureAndWorkersThatNeverJoin) {
  fake_.failing_setup = {"10.0.0.3"};
  fake_.silent = {"10.0.0.2"};  // started, but never joins
  Result<LaunchReport> report = Make().Up();
  ASSERT_TRUE(report.ok());
  EXPECT_FALSE(report->ok());
  EXPECT_NE(report->hosts[2].detail.find("only 0 of 2 workers joined within 5 s"),
            std::string::npos)
      << report->Table();
  EXPECT_NE(report->hosts[3].detail.find("setup commands failed (exit status 2: mkdir: cannot "
                                         "create directory '/data': Permission denied)"),
            std::string::npos)
      << report->Table();
  EXPECT_GE(fake_.now_ms, 5000);  // it waited out the join deadline, and no longer
  EXPECT_LT(fake_.now_ms, 6000);
}

TEST_F(LauncherTest, HeadFailureStopsBeforeAnyNode) {
  fake_.unreachable = {"10.0.0.1"};
  Result<LaunchReport> report = Make().Up();
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("ssh cannot reach 10.0.0.1"), std::string::npos)
      << report.status().ToString();
  EXPECT_TRUE(fake_.CallsWith("--cpu-workers").empty());
}

TEST_F(LauncherTest, DownStopsTheSchedulerAndChecksEveryHost) {
  Launcher launcher = Make();
  ASSERT_TRUE(launcher.Up().ok());
  fake_.calls.clear();
  Result<LaunchReport> report = launcher.Down();
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok()) << report->Table();
  ASSERT_EQ(fake_
                .CallsWith(" stop --address '10.0.0.1:7000' --token-file "
                           "'/tmp/tessera/three-head/token'")
                .size(),
            1u);
  std::vector<Call> kills = fake_.CallsWith("pkill -TERM");
  ASSERT_EQ(kills.size(), 4u);  // the head's session and each node's
  for (const Call& call : kills) {
    // The pattern cannot match the shell that runs it: "[/]tmp/..." is not "/tmp/...".
    EXPECT_NE(call.command.find("p='[/]tmp/tessera/three-"), std::string::npos) << call.command;
    EXPECT_NE(call.command.find("pkill -KILL"), std::string::npos);
  }
  EXPECT_FALSE(std::filesystem::exists(launcher.StatePath()));
  EXPECT_FALSE(std::filesystem::exists(launcher.TokenPath()));
}

TEST_F(LauncherTest, DownReportsLeftoversAndKeepsTheState) {
  Launcher launcher = Make();
  ASSERT_TRUE(launcher.Up().ok());
  fake_.stuck = {"10.0.0.3"};
  fake_.unreachable = {"10.0.0.2"};
  Result<LaunchReport> report = launcher.Down();
  ASSERT_TRUE(report.ok());
  EXPECT_FALSE(report->ok());
  EXPECT_NE(report->hosts[2].detail.find("ssh cannot reach 10.0.0.2"), std::string::npos);
  EXPECT_NE(report->hosts[3].detail.find("processes still running: 4242 tessera worker"),
            std::string::npos)
      << report->Table();
  EXPECT_TRUE(std::filesystem::exists(launcher.StatePath()));  // `down` again retries
}

TEST_F(LauncherTest, AttachSaysWhereOrWhyNot) {
  Launcher launcher = Make();
  Result<LaunchReport> none = launcher.Attach();
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(launcher.Up().ok());
  Result<LaunchReport> report = launcher.Attach();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->address, "10.0.0.1:7000");
  EXPECT_EQ(report->token_file, launcher.TokenPath());
  EXPECT_EQ(report->dashboard, "10.0.0.1:8265");  // kept in the state file by `up`
  fake_.head_running = false;
  Result<LaunchReport> gone = launcher.Attach();
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.status().message().find("is not answering"), std::string::npos);
}

// `up` reads the dashboard's address the head wrote and reports it (tessera up and attach print
// its URL); a head without a dashboard reports none.
TEST_F(LauncherTest, UpReportsTheHeadsDashboard) {
  {
    Launcher launcher = Make();
    Result<LaunchReport> report = launcher.Up();
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->dashboard, "10.0.0.1:8265");
    EXPECT_EQ(fake_.CallsWith("dashboard.address").size(), 1u);
    ASSERT_TRUE(launcher.Down().ok());
  }
  fake_.dashboard.clear();
  Launcher launcher = Make();
  Result<LaunchReport> report = launcher.Up();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->dashboard, "");
}

// Without tessera_binary, every command finds tessera on its host: the launcher's own path
// first, then PATH.
TEST_F(LauncherTest, WithoutATesseraBinaryTheHostsLookWhereTheLauncherIs) {
  spec_.tessera_binary.clear();
  Launcher launcher(spec_, {.state_dir = state_dir_, .launcher_binary = "/opt/t/bin/tessera"},
                    fake_, fake_, fake_);
  ASSERT_TRUE(launcher.Up().ok());
  ASSERT_TRUE(launcher.Down().ok());
  for (const char* what : {"start --head", "--cpu-workers", " stop --address"}) {
    std::vector<Call> calls = fake_.CallsWith(what);
    ASSERT_FALSE(calls.empty()) << what;
    for (const Call& call : calls) {
      EXPECT_NE(call.command.find(FindTesseraScript("", "/opt/t/bin/tessera")), std::string::npos)
          << call.command;
    }
  }
}

// The script, run by a real shell: the named program; else the launcher's path where it is
// executable; else `tessera` on PATH; else exit 127 naming where it looked and the fix.
TEST(FindTesseraScriptTest, NamedThenOwnPathThenPathElseAClearError) {
  const std::string dir = testing::TempPath("find_tessera");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/own");
  std::filesystem::create_directories(dir + "/path");
  const std::string own = dir + "/own/tessera";
  const std::string on_path = dir + "/path/tessera";
  ASSERT_TRUE(WriteFileAtomically(on_path, "#!/bin/sh\n", 0755).ok());
  const auto run = [&](const std::string& named, const std::string& launcher,
                       const std::string& path) {
    return RunCapturing({"/usr/bin/env", "PATH=" + path, "/bin/sh", "-c",
                         FindTesseraScript(named, launcher) + "echo \"$TESSERA_PROGRAM\""},
                        "", 10'000);
  };
  Result<CommandOutcome> named = run("/x/y/tessera", own, dir + "/path");
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(named->output, "/x/y/tessera\n");
  Result<CommandOutcome> from_path = run("", own, dir + "/path:/usr/bin:/bin");
  ASSERT_TRUE(from_path.ok());
  EXPECT_EQ(from_path->exit_code, 0) << from_path->output;
  EXPECT_EQ(from_path->output, on_path + "\n");
  ASSERT_TRUE(WriteFileAtomically(own, "#!/bin/sh\n", 0755).ok());
  Result<CommandOutcome> from_own = run("", own, dir + "/path:/usr/bin:/bin");
  ASSERT_TRUE(from_own.ok());
  EXPECT_EQ(from_own->output, own + "\n");
  std::filesystem::remove(own);
  Result<CommandOutcome> nowhere = run("", own, "/usr/bin:/bin");
  ASSERT_TRUE(nowhere.ok());
  EXPECT_EQ(nowhere->exit_code, 127);
  EXPECT_NE(nowhere->output.find("tessera: not found at " + own +
                                 " (where `tessera up` runs from) nor on PATH on "),
            std::string::npos)
      << nowhere->output;
  EXPECT_NE(nowhere->output.find("name it with tessera_binary in the cluster file or "
                                 "--tessera-binary"),
            std::string::npos);
  Result<CommandOutcome> no_launcher = run("", "", "/usr/bin:/bin");
  ASSERT_TRUE(no_launcher.ok());
  EXPECT_EQ(no_launcher->exit_code, 127);
  EXPECT_NE(no_launcher->output.find("tessera: not found on PATH on "), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(ShellQuoteTest, QuotesForPosixShells) {
  EXPECT_EQ(ShellQuote("plain"), "'plain'");
  EXPECT_EQ(ShellQuote("it's"), "'it'\\''s'");
  EXPECT_EQ(Tail("a\nb\n\n"), "a | b");
}

TEST(SshShellTest, SshArgvNeverPromptsAndEndsWithTheCommand) {
  SshShellOptions options;
  options.ssh.user = "root";
  options.ssh.key = "/k/id";
  options.ssh.port = 2222;
  options.ssh.options = {"Compression=no"};
  options.known_hosts = "/state/known_hosts";
  const std::vector<std::string> argv = SshArgv(options, "10.0.0.2", "", "echo hi");
  const std::string joined = fmt::format("{}", fmt::join(argv, " "));
  EXPECT_EQ(argv.front(), "ssh");
  EXPECT_NE(joined.find("-o BatchMode=yes"), std::string::npos);
  EXPECT_NE(joined.find("-o StrictHostKeyChecking=accept-new"), std::string::npos);
  EXPECT_NE(joined.find("-o UserKnownHostsFile=/state/known_hosts"), std::string::npos);
  EXPECT_NE(joined.find("-i /k/id"), std::string::npos);
  EXPECT_NE(joined.find("-p 2222"), std::string::npos);
  EXPECT_NE(joined.find("-o Compression=no"), std::string::npos);
  ASSERT_GE(argv.size(), 3u);
  EXPECT_EQ(argv[argv.size() - 3], "root@10.0.0.2");
  EXPECT_EQ(argv.back(), "echo hi");
  EXPECT_EQ(SshArgv(options, "h", "bob", "x")[argv.size() - 3], "bob@h");
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.1"));
}

TEST(SshShellTest, RunCapturingGivesInputAndCollectsOutputAndStatus) {
  Result<CommandOutcome> outcome =
      RunCapturing({"/bin/sh", "-c", "cat; echo err >&2; exit 3"}, "in\n", 10'000);
  ASSERT_TRUE(outcome.ok()) << outcome.status().ToString();
  EXPECT_EQ(outcome->exit_code, 3);
  EXPECT_EQ(outcome->output, "in\nerr\n");
  Result<CommandOutcome> slow = RunCapturing({"/bin/sh", "-c", "sleep 20"}, "", 200);
  ASSERT_FALSE(slow.ok());
  EXPECT_EQ(slow.status().code(), StatusCode::kTimedOut);
  Result<CommandOutcome> missing = RunCapturing({"/nonexistent/ssh"}, "", 5'000);
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(missing->exit_code, 127);
}

}  // namespace
}  // namespace tessera::launcher

namespace tessera::launcher {
namespace {

TEST(SlurmTest, HostlistsExpandInOrderWithTheirPadding) {
  const auto expand = [](std::string_view list) {
    Result<std::vector<std::string>> hosts = ExpandHostlist(list);
    EXPECT_TRUE(hosts.ok()) << list << ": " << hosts.status().ToString();
    return hosts.ok() ? *hosts : std::vector<std::string>{};
  };
  EXPECT_EQ(expand("node1"), (std::vector<std::string>{"node1"}));
  EXPECT_EQ(expand("ts5-h[1-3]"), (std::vector<std::string>{"ts5-h1", "ts5-h2", "ts5-h3"}));
  EXPECT_EQ(expand("n[08-10,12],login"),
            (std::vector<std::string>{"n08", "n09", "n10", "n12", "login"}));
  EXPECT_EQ(expand("r[1-2]-n[01-02]"),
            (std::vector<std::string>{"r1-n01", "r1-n02", "r2-n01", "r2-n02"}));
  EXPECT_EQ(expand("gpu[3],cpu[001-002].cluster"),
            (std::vector<std::string>{"gpu3", "cpu001.cluster", "cpu002.cluster"}));
}

TEST(SlurmTest, BadHostlistsAreNamed) {
  for (const char* bad :
       {"n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n1,,n2", "n[1-99999999999]", "n[0-70000]"}) {
    Result<std::vector<std::string>> hosts = ExpandHostlist(bad);
    ASSERT_FALSE(hosts.ok()) << bad;
    EXPECT_EQ(hosts.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(hosts.status().message().find(bad), std::string::npos) << hosts.status().message();
  }
}

TEST(SlurmTest, CpusPerNodeExpand) {
  Result<std::vector<int>> cpus = ExpandCpusPerNode("16(x3),8", 4);
  ASSERT_TRUE(cpus.ok()) << cpus.status().ToString();
  EXPECT_EQ(*cpus, (std::vector<int>{16, 16, 16, 8}));
  EXPECT_FALSE(ExpandCpusPerNode("16(x3)", 4).ok());  // too few nodes
  EXPECT_FALSE(ExpandCpusPerNode("16(x3", 3).ok());   // unclosed
  EXPECT_FALSE(ExpandCpusPerNode("x,8", 2).ok());     // not a number
}

TEST(SlurmTest, TheAllocationComesFromTheEnvironment) {
  std::map<std::string, std::string> env = {{"SLURM_JOB_ID", "42"},
                                            {"SLURM_JOB_NODELIST", "ts5-h[1-3]"},
                                            {"SLURM_JOB_CPUS_PER_NODE", "2(x3)"}};
  const auto getenv = [&env](const char* name) -> std::optional<std::string> {
    auto it = env.find(name);
    return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  Result<SlurmAllocation> allocation = SlurmAllocationFromEnvironment(getenv);
  ASSERT_TRUE(allocation.ok()) << allocation.status().ToString();
  EXPECT_EQ(allocation->job_id, "42");
  EXPECT_EQ(allocation->nodes, (std::vector<std::string>{"ts5-h1", "ts5-h2", "ts5-h3"}));
  EXPECT_EQ(allocation->cpus, (std::vector<int>{2, 2, 2}));

  const ClusterSpec spec =
      SlurmClusterSpec(*allocation, {.port = 7100, .workers_per_node = 2, .threads = 0});
  EXPECT_EQ(spec.name, "slurm-42");
  EXPECT_EQ(spec.head.address, "ts5-h1");
  EXPECT_EQ(spec.head.port, 7100);
  ASSERT_EQ(spec.nodes.size(), 3u);
  for (const NodeSpec& node : spec.nodes) {
    EXPECT_EQ(node.workers, 2);
    EXPECT_EQ(node.threads, 1);  // 2 CPUs over 2 workers
  }
  EXPECT_EQ(spec.ExpectedWorkers(), 6);

  env.erase("SLURM_JOB_NODELIST");
  Result<SlurmAllocation> outside = SlurmAllocationFromEnvironment(getenv);
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find("salloc"), std::string::npos);
}

TEST(SlurmTest, SrunArgvRunsOneOverlappingStepOnTheNode) {
  const std::vector<std::string> argv = SrunArgv("srun", "ts5-h2", "echo hi");
  ASSERT_GE(argv.size(), 4u);
  EXPECT_EQ(argv.front(), "srun");
  for (const char* flag : {"--overlap", "--nodes=1", "--ntasks=1", "--nodelist=ts5-h2"}) {
    EXPECT_NE(std::find(argv.begin(), argv.end(), flag), argv.end()) << flag;
  }
  EXPECT_EQ((std::vector<std::string>(argv.end() - 3, argv.end())),
            (std::vector<std::string>{"/bin/sh", "-c", "echo hi"}));
}

// A stand-in for srun: runs the step's command here (everything after /bin/sh), or fails as
// srun does when its first argument after the options is "--nodelist=down".
std::string FakeSrun(const std::string& dir) {
  std::string path = dir + "/srun";
  EXPECT_TRUE(WriteFileAtomically(path, R"(#!/bin/sh
for arg; do
  case "$arg" in --nodelist=down) echo "srun: error: Unable to create step for job 7: Invalid node name specified" >&2; exit 1 ;; esac
done
while [ "$1" != /bin/sh ]; do shift; done
exec "$@"
)",
                                  0755)
                  .ok());
  return path;
}

TEST(SlurmTest, SrunShellRunsAStepAndNamesSrunsErrors) {
  const std::string dir = testing::TempPath("srun_shell");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  SrunShell shell({.srun_binary = FakeSrun(dir), .log_dir = dir});
  Result<CommandOutcome> ran = shell.Run("ts5-h2", "", "cat; echo out; exit 3", "in\n", 10000);
  ASSERT_TRUE(ran.ok()) << ran.status().ToString();
  EXPECT_EQ(ran->exit_code, 3);
  EXPECT_EQ(ran->output, "in\nout\n");
  Result<CommandOutcome> down = shell.Run("down", "", "true", "", 10000);
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(down.status().message().find("Invalid node name"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(SlurmTest, StartBlockingReturnsOnceUpAndLeavesTheStepRunning) {
  const std::string dir = testing::TempPath("srun_blocking");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  SrunShell shell({.srun_binary = FakeSrun(dir), .log_dir = dir});
  // Reads its input (a token), says it is up, then holds until its marker file goes.
  const std::string marker = dir + "/holding";
  const std::string command = "read token; echo \"got $token\"; touch " + marker + "; echo '" +
                              std::string(kBlockingStartedLine) + "'; while [ -e " + marker +
                              " ]; do sleep 0.05; done; echo released";
  Result<CommandOutcome> up = shell.StartBlocking("ts5-h3", "", command, "s3cret\n", 10000);
  ASSERT_TRUE(up.ok()) << up.status().ToString();
  EXPECT_EQ(up->exit_code, 0);
  EXPECT_NE(up->output.find("got s3cret"), std::string::npos) << up->output;
  EXPECT_TRUE(std::filesystem::exists(marker));  // still holding: the step was left running
  std::filesystem::remove(marker);

  // A command that ends before it is up: its status and output.
  Result<CommandOutcome> failed =
      shell.StartBlocking("ts5-h3", "", "echo 'no scheduler' >&2; exit 4", "", 10000);
  ASSERT_TRUE(failed.ok()) << failed.status().ToString();
  EXPECT_EQ(failed->exit_code, 4);
  EXPECT_NE(failed->output.find("no scheduler"), std::string::npos);

  // One that never says so is killed at the deadline.
  Result<CommandOutcome> silent = shell.StartBlocking("ts5-h3", "", "sleep 30", "", 300);
  ASSERT_FALSE(silent.ok());
  EXPECT_EQ(silent.status().code(), StatusCode::kTimedOut);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera::launcher
