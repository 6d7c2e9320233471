// Collectives between real processes over UCX (shared memory / CMA on this host): groups of 2,
// 3, 4 and 8 member processes run every op and dtype against the naive reference, up to 64 MiB;
// a killed member and a stuck member make every other member fail, naming it.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "launcher/process.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using Clock = std::chrono::steady_clock;

struct Member {
  pid_t pid = -1;
  std::string log;
  int exit_code = -1;  // after Reap; -1: killed by a signal or never exited
};

class Group {
 public:
  Group(const std::string& name, int size, const std::string& extra_flags) {
    directory_ = TempPath("collectives_" + name);
    std::filesystem::remove_all(directory_);
    std::filesystem::create_directories(directory_);
    const std::string rendezvous = "unix:" + directory_ + "/rendezvous.sock";
    for (int r = 0; r < size; ++r) {
      Member member;
      member.log = directory_ + "/rank" + std::to_string(r) + ".log";
      std::vector<std::string> argv = {BinaryPath("collective_member"),
                                       "--rank",
                                       std::to_string(r),
                                       "--size",
                                       std::to_string(size),
                                       "--rendezvous",
                                       rendezvous};
      std::istringstream flags(extra_flags);
      for (std::string flag; flags >> flag;) argv.push_back(flag);
      SpawnOptions options;
      options.log_file = member.log;
      Result<pid_t> pid = SpawnProcess(argv, options);
      EXPECT_TRUE(pid.ok()) << pid.status().ToString();
      member.pid = pid.ok() ? *pid : -1;
      members_.push_back(member);
    }
  }
  ~Group() {
    for (Member& member : members_) {
      if (member.pid > 0 && ProcessAlive(member.pid)) StopProcess(member.pid, 1000);
    }
  }

  Member& operator[](int rank) { return members_[static_cast<size_t>(rank)]; }

  // Waits for every member but `except` to exit, for at most `limit` (a guard against hangs;
  // the members' own deadlines are what is being tested). Returns false on the guard.
  bool WaitForExit(std::chrono::seconds limit, int except = -1) {
    const Clock::time_point until = Clock::now() + limit;
    for (size_t r = 0; r < members_.size(); ++r) {
      if (static_cast<int>(r) == except) continue;
      Member& member = members_[r];
      while (true) {
        int status = 0;
        const pid_t done = ::waitpid(member.pid, &status, WNOHANG);
        if (done == member.pid) {
          member.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
          break;
        }
        if (Clock::now() > until) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    return true;
  }

  // Waits until every member's log contains `text`.
  bool WaitForLogs(const std::string& text, std::chrono::seconds limit) {
    const Clock::time_point until = Clock::now() + limit;
    for (const Member& member : members_) {
      while (ReadFileText(member.log).find(text) == std::string::npos) {
        if (Clock::now() > until) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    return true;
  }

  std::string Logs() const {
    std::string all;
    for (const Member& member : members_) all += ReadFileText(member.log);
    return all;
  }

 private:
  std::string directory_;
  std::vector<Member> members_;
};

class CollectivesProcessTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesProcessTest, EveryOpAndDtypeMatchesTheReference) {
  const int size = GetParam();
  Group group("suite" + std::to_string(size), size, "--mode suite --large-mb 64");
  ASSERT_TRUE(group.WaitForExit(std::chrono::seconds(600))) << group.Logs();
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(group[r].exit_code, 0) << group.Logs();
  }
  EXPECT_NE(group.Logs().find("rank 0: suite passed"), std::string::npos) << group.Logs();
}

// Four processes with single copies above 8 KiB (what ranks that outnumber their cores use): the
// direct algorithm's and the ring's mid-sized messages take the single-copy path.
TEST(CollectivesProcessTest, FourProcessesCopyingOnceAboveEightKiBMatchTheReference) {
  Group group("copy8k", 4, "--mode suite --large-mb 8 --single-copy-bytes 8193");
  ASSERT_TRUE(group.WaitForExit(std::chrono::seconds(600))) << group.Logs();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(group[r].exit_code, 0) << group.Logs();
  EXPECT_NE(group.Logs().find("rank 0: suite passed"), std::string::npos) << group.Logs();
}

// The path between hosts, on this one: TCP over the loopback interface, UCX's peer-failure mode.
TEST(CollectivesNetworkTest, ThreeProcessesOverTcpMatchTheReference) {
  Group group("tcp", 3, "--mode suite --large-mb 8 --network-only");
  ASSERT_TRUE(group.WaitForExit(std::chrono::seconds(600))) << group.Logs();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(group[r].exit_code, 0) << group.Logs();
}

TEST(CollectivesNetworkTest, AKilledMemberOverTcpFailsTheOthersNamingIt) {
  const int size = 3, victim = 1;
  Group group("tcp_killed", size,
              "--mode loop --loop-elements 1000000 --timeout-ms 600000 --network-only");
  ASSERT_TRUE(group.WaitForLogs("looping", std::chrono::seconds(60))) << group.Logs();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(group[victim].pid, SIGKILL);
  ASSERT_TRUE(group.WaitForExit(std::chrono::seconds(60), victim)) << group.Logs();
  for (int r : {0, 2}) {
    const std::string log = ReadFileText(group[r].log);
    EXPECT_EQ(group[r].exit_code, 1) << log;
    EXPECT_NE(log.find("rank 1 died"), std::string::npos) << log;
  }
}

INSTANTIATE_TEST_SUITE_P(Processes, CollectivesProcessTest, ::testing::Values(2, 3, 4, 8),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "processes";
                         });

// The deadline is far away, so a member that fails has learned of the death, not waited it out.
TEST(CollectivesFailureTest, AKilledMemberFailsEveryOtherNamingIt) {
  const int size = 4, victim = 2;
  Group group("killed", size, "--mode loop --loop-elements 1000000 --timeout-ms 600000");
  ASSERT_TRUE(group.WaitForLogs("looping", std::chrono::seconds(60))) << group.Logs();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // mid-collective
  ::kill(group[victim].pid, SIGKILL);
  ASSERT_TRUE(group.WaitForExit(std::chrono::seconds(60), victim)) << group.Logs();
  for (int r = 0; r < size; ++r) {
    if (r == victim) continue;
    const std::string log = ReadFileText(group[r].log);
    EXPECT_EQ(group[r].exit_code, 1) << log;
    EXPECT_NE(log.find("rank 2 died"), std::string::npos) << log;
  }
}

// A stopped (alive but silent) member: the others time out after the configured deadline, and
// all of them name the stuck member rather than the neighbour each happened to wait on.
TEST(CollectivesFailureTest, AStuckMemberTimesOutEveryOtherNamingIt) {
  const int size = 4, victim = 1;
  Group group("stuck", size, "--mode loop --loop-elements 1000000 --timeout-ms 2000");
  ASSERT_TRUE(group.WaitForLogs("looping", std::chrono::seconds(60))) << group.Logs();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(group[victim].pid, SIGSTOP);
  const bool exited = group.WaitForExit(std::chrono::seconds(60), victim);
  ::kill(group[victim].pid, SIGKILL);
  ASSERT_TRUE(exited) << group.Logs();
  for (int r = 0; r < size; ++r) {
    if (r == victim) continue;
    const std::string log = ReadFileText(group[r].log);
    EXPECT_EQ(group[r].exit_code, 1) << log;
    EXPECT_NE(log.find("heard nothing from rank 1 "), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace tessera::testing
