// The `tessera` command as an operator uses it: start a head and workers, look, stop.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "driver/cluster.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

ProcessResult Tessera(const std::string& arguments) { return RunBinary("tessera", arguments); }

std::string ReadAll(const std::string& path) {
  std::ifstream file(path);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

std::string ReadLine(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

TEST(TesseraCliTest, StartStatusStop) {
  const std::string session = TempPath("tessera_cli_session");
  std::filesystem::remove_all(session);
  ProcessResult head = Tessera("start --head --port 0 --session-dir " + session);
  ASSERT_EQ(head.exit_code, 0) << head.output;
  const std::string address = ReadLine(session + "/scheduler.address");
  const std::string token = session + "/token";
  ASSERT_FALSE(address.empty());
  EXPECT_NE(head.output.find(address), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(session + "/scheduler.sock"));

  const std::string target = " --address " + address + " --token-file " + token;
  ProcessResult workers =
      Tessera("start --cpu-workers 2 --threads 1 --host-memory-mb 256" + target);
  EXPECT_EQ(workers.exit_code, 0) << workers.output;
  EXPECT_NE(workers.output.find("2 alive in total"), std::string::npos) << workers.output;

  ProcessResult status = Tessera("status" + target);
  EXPECT_EQ(status.exit_code, 0) << status.output;
  EXPECT_NE(status.output.find("2 of 2 workers alive"), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("256.0 MiB"), std::string::npos) << status.output;

  ProcessResult gpus = Tessera("start --gpus all" + target);
  EXPECT_EQ(gpus.exit_code, 1);
  EXPECT_NE(gpus.output.find("--cpu-workers"), std::string::npos) << gpus.output;

  ProcessResult wrong_token =
      Tessera("status --address " + address + " --token-file /etc/hostname");
  EXPECT_EQ(wrong_token.exit_code, 1);
  EXPECT_NE(wrong_token.output.find("invalid cluster token"), std::string::npos)
      << wrong_token.output;

  ProcessResult stop = Tessera("stop" + target);
  EXPECT_EQ(stop.exit_code, 0) << stop.output;
  EXPECT_NE(stop.output.find("stopped"), std::string::npos) << stop.output;
  // The scheduler logged the workers joining and leaving, in the session directory.
  std::ifstream log(session + "/scheduler.log");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("joined"), std::string::npos);
  EXPECT_NE(text.find("stopped"), std::string::npos);
}

// The scheduler dies (SIGKILL) in the middle of a ZeRO-3 run on workers `tessera start` made:
// the driver fails naming the lost scheduler, and every worker exits instead of lingering with
// its memory (they used to deadlock while ending their collective stream).
TEST(TesseraCliTest, WorkersAndTheDriverExitWhenTheSchedulerDiesMidRun) {
  const std::string session = TempPath("tessera_cli_scheduler_death");
  std::filesystem::remove_all(session);
  ASSERT_EQ(Tessera("start --head --port 0 --session-dir " + session).exit_code, 0);
  const std::string address = ReadLine(session + "/scheduler.address");
  const std::string token = session + "/token";
  ProcessResult workers =
      Tessera("start --cpu-workers 3 --threads 1 --address " + address + " --token-file " + token);
  ASSERT_EQ(workers.exit_code, 0) << workers.output;
  ConnectOptions admin;
  admin.token_file = token;
  admin.admin = true;
  std::vector<int> worker_pids;
  {
    ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::Connect(address, admin));
    ASSERT_OK_AND_ASSIGN(ClusterInfo info, cluster->Info());
    for (const WorkerInfo& worker : info.workers) worker_pids.push_back(worker.pid);
  }
  ASSERT_EQ(worker_pids.size(), 3u);

  const std::string log = session + "/driver.log";
  const pid_t driver = ::fork();
  ASSERT_GE(driver, 0);
  if (driver == 0) {
    const std::string binary = BinaryPath("train_gpt2");
    ::freopen(log.c_str(), "w", stdout);
    ::dup2(STDOUT_FILENO, STDERR_FILENO);
    ::execl(binary.c_str(), binary.c_str(), "--address", address.c_str(), "--token-file",
            token.c_str(), "--workers", "3", "--zero-stage", "3", "--batch", "9", "--steps",
            "1000000", "--log-every", "1", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Training is under way: a few steps done.
  ASSERT_TRUE(Eventually([&] { return ReadAll(log).find("step 5/") != std::string::npos; },
                         std::chrono::seconds(60)))
      << ReadAll(log);
  ASSERT_EQ(::kill(std::stoi(ReadLine(session + "/scheduler.pid")), SIGKILL), 0);
  int status = 0;
  ASSERT_TRUE(Eventually([&] { return ::waitpid(driver, &status, WNOHANG) == driver; },
                         std::chrono::seconds(20)))
      << "the driver outlived its scheduler";
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_NE(ReadAll(log).find("lost the connection to the scheduler"), std::string::npos)
      << ReadAll(log);
  EXPECT_TRUE(
      Eventually([&] { return std::all_of(worker_pids.begin(), worker_pids.end(), ProcessGone); },
                 std::chrono::seconds(20)));
  for (int pid : worker_pids) {
    EXPECT_TRUE(ProcessGone(pid)) << "worker pid " << pid << " outlived its scheduler";
    if (!ProcessGone(pid)) ::kill(pid, SIGKILL);
  }
}

TEST(TesseraCliTest, NonsenseIsExplained) {
  ProcessResult none = Tessera("");
  EXPECT_EQ(none.exit_code, 2);
  ProcessResult bad = Tessera("start --head --port 99999");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("99999"), std::string::npos) << bad.output;
  ProcessResult unreachable = Tessera("status --address 127.0.0.1:1 --token-file /etc/hostname");
  EXPECT_EQ(unreachable.exit_code, 1);
  EXPECT_NE(unreachable.output.find("127.0.0.1:1"), std::string::npos) << unreachable.output;
}

}  // namespace
}  // namespace tessera::testing
