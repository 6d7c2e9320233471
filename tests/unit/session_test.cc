// LocalSession, the one launch path of `tessera start` and Cluster::StartLocal: the session
// directory and its token, and start-up failures reported with the process's own words instead
// of a hang, and where the tessera binary is looked for. Small shell scripts stand in for the
// tessera binary.
#include <sys/stat.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <set>

#include <fmt/format.h>

#include "core/atomic_file.h"
#include "launcher/process.h"
#include "launcher/session.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

std::string TempDir(const std::string& name) {
  std::string dir = TempPath("session_test_" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

// An executable script standing in for `tessera` (it is run as `<script> scheduler ...`).
std::string FakeBinary(const std::string& dir, const std::string& body) {
  std::filesystem::create_directories(dir);
  std::string path = dir + "/fake-tessera";
  std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

TEST(SessionTest, ANewSessionHoldsAPrivateTokenAndReopens) {
  const std::string dir = TempDir("new");
  ASSERT_OK_AND_ASSIGN(LocalSession session, LocalSession::Create(dir, "test", {}));
  EXPECT_EQ(session.dir(), dir);
  EXPECT_EQ(session.token().size(), 64u);
  struct stat info {};
  ASSERT_EQ(::stat(session.token_file().c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600);
  ASSERT_OK_AND_ASSIGN(LocalSession reopened, LocalSession::Open(dir, {}));
  EXPECT_EQ(reopened.token(), session.token());
  // Two fresh sessions never share a directory or a token.
  ASSERT_OK_AND_ASSIGN(LocalSession a, LocalSession::Create("", "test", {}));
  ASSERT_OK_AND_ASSIGN(LocalSession b, LocalSession::Create("", "test", {}));
  EXPECT_NE(a.dir(), b.dir());
  EXPECT_NE(a.token(), b.token());
  std::filesystem::remove_all(a.dir());
  std::filesystem::remove_all(b.dir());
}

// A session of `root` as the launcher leaves one: a token, and the pids of its processes.
std::string FakeSession(const std::string& root, const std::string& name, pid_t pid) {
  std::string dir = root + "/" + name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/token") << "t\n";
  std::ofstream(dir + "/pids") << "scheduler " << pid << "\n";
  return dir;
}

// A pid no process has: a child that exited and was reaped.
pid_t GonePid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

TEST(SessionTest, TheSessionRootIsTheTempDirElseTheUsersOwn) {
  EXPECT_EQ(SessionRoot("/data/t"), "/data/t");
  EXPECT_EQ(LatestSession("/data/t"), "/data/t/session_latest");
  const std::string root = SessionRoot("");
  EXPECT_TRUE(root.starts_with("/tmp/tessera-")) << root;
  EXPECT_GT(root.size(), std::string("/tmp/tessera-").size());
  // A new session goes under the temp dir given.
  const std::string temp = TempDir("root");
  ASSERT_OK_AND_ASSIGN(LocalSession session, LocalSession::Create("", "local", {.temp_dir = temp}));
  EXPECT_EQ(std::filesystem::path(session.dir()).parent_path().string(), temp);
  EXPECT_TRUE(std::filesystem::path(session.dir()).filename().string().starts_with("local_"));
  // Without one, under this user's root, which only this user may enter.
  ASSERT_OK_AND_ASSIGN(LocalSession own, LocalSession::Create("", "test", {}));
  EXPECT_EQ(std::filesystem::path(own.dir()).parent_path().string(), root);
  struct stat info {};
  ASSERT_EQ(::stat(root.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0700);
  EXPECT_EQ(info.st_uid, ::geteuid());
  std::filesystem::remove_all(own.dir());
  std::filesystem::remove_all(temp);
}

TEST(SessionTest, TheLatestLinkMovesAtomicallyAndIsGivenBack) {
  const std::string root = TempDir("latest");
  const std::string running = FakeSession(root, "running", ::getpid());
  const std::string ended = FakeSession(root, "ended", GonePid());
  const std::string mine = FakeSession(root, "mine", ::getpid());
  EXPECT_TRUE(SessionRuns(running));
  EXPECT_FALSE(SessionRuns(ended));
  EXPECT_FALSE(SessionRuns(root + "/nothing"));
  const std::string link = root + "/session_latest";
  ASSERT_OK_AND_ASSIGN(std::string none, LinkLatestSession(root, running));
  EXPECT_EQ(none, "");
  ASSERT_OK_AND_ASSIGN(std::string previous, LinkLatestSession(root, mine));
  EXPECT_EQ(previous, running);
  EXPECT_EQ(std::filesystem::read_symlink(link).string(), mine);
  // Given back to the session it named before, which still runs...
  UnlinkLatestSession(root, mine, previous);
  EXPECT_EQ(std::filesystem::read_symlink(link).string(), running);
  // ...but not to one that ended: then removed.
  ASSERT_OK(LinkLatestSession(root, mine).status());
  UnlinkLatestSession(root, mine, ended);
  EXPECT_FALSE(std::filesystem::is_symlink(link));
  // A later session's link is left alone.
  ASSERT_OK(LinkLatestSession(root, running).status());
  UnlinkLatestSession(root, mine, "");
  EXPECT_EQ(std::filesystem::read_symlink(link).string(), running);
  std::filesystem::remove_all(root);
}

// Commands without --address use the latest session's scheduler, unless that session ended (a
// driver killed before it could take its link back): then they say so.
TEST(SessionTest, TheLatestSessionsAddressUnlessItEnded) {
  const std::string root = TempDir("latest_address");
  Result<std::string> none = SchedulerAddressOrLatest("", root);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no running session found"), std::string::npos);
  EXPECT_EQ(*SchedulerAddressOrLatest("10.0.0.1:7000", root), "10.0.0.1:7000");
  const std::string running = FakeSession(root, "running", ::getpid());
  std::ofstream(running + "/scheduler.address") << "127.0.0.1:7001\n";
  ASSERT_OK(LinkLatestSession(root, running).status());
  EXPECT_EQ(*SchedulerAddressOrLatest("", root), "127.0.0.1:7001");
  EXPECT_EQ(TokenFileOrLatest("", root), root + "/session_latest/token");
  const std::string ended = FakeSession(root, "ended", GonePid());
  std::ofstream(ended + "/scheduler.address") << "127.0.0.1:7002\n";
  ASSERT_OK(LinkLatestSession(root, ended).status());
  Result<std::string> gone = SchedulerAddressOrLatest("", root);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("has ended"), std::string::npos)
      << gone.status().message();
  std::filesystem::remove_all(root);
}

TEST(SessionTest, EndedSessionsAreRemovedButTheNewestFewAndRunningOnes) {
  const std::string root = TempDir("ended");
  const pid_t gone = GonePid();
  const auto an_hour_ago = std::filesystem::file_time_type::clock::now() - std::chrono::hours(1);
  std::vector<std::string> ended;
  for (int i = 0; i < 8; ++i) {  // ended, the later ones changed last
    ended.push_back(FakeSession(root, "ended" + std::to_string(i), gone));
    std::filesystem::last_write_time(ended.back(), an_hour_ago + std::chrono::minutes(i));
  }
  const std::string running = FakeSession(root, "running", ::getpid());
  std::filesystem::last_write_time(running, an_hour_ago);
  const std::string fresh = FakeSession(root, "fresh", gone);  // may be starting: kept
  const std::string excepted = FakeSession(root, "excepted", gone);
  std::filesystem::last_write_time(excepted, an_hour_ago - std::chrono::hours(1));
  std::filesystem::create_directories(root + "/clusters");  // not a session (no token)
  std::filesystem::last_write_time(root + "/clusters", an_hour_ago);
  EXPECT_EQ(RemoveEndedSessions(root, 5, excepted), 3);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(std::filesystem::exists(ended[static_cast<size_t>(i)]), i >= 3) << i;
  }
  EXPECT_TRUE(std::filesystem::exists(running));
  EXPECT_TRUE(std::filesystem::exists(fresh));
  EXPECT_TRUE(std::filesystem::exists(excepted));
  EXPECT_TRUE(std::filesystem::exists(root + "/clusters"));
  EXPECT_EQ(RemoveEndedSessions(root + "/missing", 5, ""), 0);
  std::filesystem::remove_all(root);
}

// Every process a session starts is recorded in its pids file, so SessionRuns sees it.
TEST(SessionTest, StartedProcessesAreRecorded) {
  const std::string dir = TempDir("pids");
  const std::string binary = FakeBinary(dir + "-bin", "sleep 30");
  ASSERT_OK_AND_ASSIGN(LocalSession session, LocalSession::Create(dir, "test", {.binary = binary}));
  EXPECT_FALSE(SessionRuns(dir));
  ASSERT_OK_AND_ASSIGN(std::vector<pid_t> pids,
                       session.StartWorkers({.scheduler = "127.0.0.1:1", .count = 2, .tag = "t"}));
  ASSERT_EQ(pids.size(), 2u);
  const std::string listed = ReadFileText(dir + "/pids");
  EXPECT_NE(listed.find(fmt::format("worker-t-0 {}\n", pids[0])), std::string::npos) << listed;
  EXPECT_NE(listed.find(fmt::format("worker-t-1 {}\n", pids[1])), std::string::npos) << listed;
  EXPECT_TRUE(SessionRuns(dir));
  for (pid_t pid : pids) StopProcess(pid, 1000);
  EXPECT_FALSE(SessionRuns(dir));
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir + "-bin");
}

TEST(SessionTest, ATokenOutsideASessionGetsANodeSessionWithACopy) {
  const std::string dir = TempDir("foreign");
  std::filesystem::create_directories(dir);
  ASSERT_OK(WriteFileAtomically(dir + "/cluster.secret", "abc123\n", 0600));
  ASSERT_OK_AND_ASSIGN(LocalSession node, LocalSession::ForToken(dir + "/cluster.secret", {}));
  EXPECT_NE(node.dir(), dir);
  EXPECT_EQ(node.token(), "abc123");
  EXPECT_EQ(*ReadFileTrimmed(node.token_file()), "abc123");
  std::filesystem::remove_all(node.dir());

  Result<LocalSession> missing = LocalSession::ForToken(dir + "/nothing", {});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(dir + "/nothing"), std::string::npos);
  Result<LocalSession> not_a_session = LocalSession::Open(dir, {});
  ASSERT_FALSE(not_a_session.ok());
  EXPECT_EQ(not_a_session.status().code(), StatusCode::kNotFound);
  EXPECT_NE(not_a_session.status().message().find("no token file"), std::string::npos);
}

TEST(SessionTest, StartUpFailuresSayWhatTheProcessSaid) {
  const std::string dir = TempDir("failures");
  // A scheduler that dies at once.
  {
    const std::string binary = FakeBinary(dir + "/bin1", "echo 'cannot bind port 6380'; exit 3");
    ASSERT_OK_AND_ASSIGN(LocalSession session,
                         LocalSession::Create(dir + "/s1", "test", {.binary = binary}));
    Result<StartedScheduler> started = session.StartScheduler({.timeout_ms = 20'000});
    ASSERT_FALSE(started.ok());
    EXPECT_EQ(started.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(started.status().message().find("cannot bind port 6380"), std::string::npos)
        << started.status().ToString();
  }
  // A scheduler that never listens.
  {
    const std::string binary =
        FakeBinary(dir + "/bin2", "echo 'waiting for nothing'; exec sleep 30");
    ASSERT_OK_AND_ASSIGN(LocalSession session,
                         LocalSession::Create(dir + "/s2", "test", {.binary = binary}));
    Result<StartedScheduler> started = session.StartScheduler({.timeout_ms = 300});
    ASSERT_FALSE(started.ok());
    EXPECT_EQ(started.status().code(), StatusCode::kTimedOut);
    EXPECT_NE(started.status().message().find("waiting for nothing"), std::string::npos)
        << started.status().ToString();
  }
  // Workers, one of which fails.
  {
    const std::string binary = FakeBinary(
        dir + "/bin3",
        "case \"$*\" in *spill-x-1*) echo 'no such device'; exit 4;; esac; exec sleep 30");
    ASSERT_OK_AND_ASSIGN(LocalSession session,
                         LocalSession::Create(dir + "/s3", "test", {.binary = binary}));
    const WorkerLaunch launch{.scheduler = "unix:/nowhere", .count = 2, .tag = "x"};
    ASSERT_OK_AND_ASSIGN(std::vector<pid_t> pids, session.StartWorkers(launch));
    ASSERT_EQ(pids.size(), 2u);
    const Status joined =
        session.AwaitWorkers([]() -> Result<int> { return 0; }, 2, pids, launch, 20'000);
    ASSERT_FALSE(joined.ok());
    EXPECT_EQ(joined.code(), StatusCode::kUnavailable);
    EXPECT_NE(joined.message().find("worker x-1 exited"), std::string::npos) << joined.ToString();
    EXPECT_NE(joined.message().find("no such device"), std::string::npos) << joined.ToString();
    EXPECT_TRUE(std::filesystem::exists(session.dir() + "/worker-x-0.log"));
    for (pid_t pid : pids) ::kill(pid, SIGKILL);
  }
  EXPECT_EQ(LocalSession::Create(dir + "/s4", "test", {})
                .value()
                .StartWorkers({.count = 0})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

// Every place FindTesseraBinary may look, each holding a `tessera` only when listed in `present`.
struct BinarySearch {
  TesseraBinaryPlaces places{.flag = "",
                             .env_binary = "",
                             .env_bin_dir = "/env-dir",
                             .executable_dir = "/exe-dir",
                             .sdk_bin_dir = "/sdk/bin",
                             .configured_bin_dir = "/usr/local/bin",
                             .path = "/path-a::/path-b"};
  std::set<std::string> present;
  Result<std::string> Find() const {
    return FindTesseraBinaryIn(places,
                               [&](const std::string& file) { return present.contains(file); });
  }
};

// The reaper reaps the children it was given once they exit, and only those: a child it was not
// given stays for its own waiter.
TEST(ChildReaperTest, ReapsTheGivenChildrenThatExitAndNoOthers) {
  ASSERT_OK_AND_ASSIGN(const pid_t other, SpawnProcess({"/bin/sh", "-c", "exit 0"}, {}));
  ASSERT_OK_AND_ASSIGN(const pid_t quick, SpawnProcess({"/bin/sh", "-c", "exit 3"}, {}));
  ASSERT_OK_AND_ASSIGN(const pid_t slow, SpawnProcess({"/bin/sleep", "30"}, {}));
  ChildReaper reaper(std::chrono::milliseconds(10));
  reaper.Add(quick);
  reaper.Add(slow);
  EXPECT_TRUE(Eventually([&] { return reaper.Children() == std::vector<pid_t>{slow}; }));
  EXPECT_FALSE(std::filesystem::exists("/proc/" + std::to_string(quick))) << "reaped";
  EXPECT_TRUE(Eventually([&] { return ProcessGone(other); }));
  EXPECT_TRUE(std::filesystem::exists("/proc/" + std::to_string(other))) << "left to its waiter";
  int status = 0;
  EXPECT_EQ(::waitpid(other, &status, 0), other);
  EXPECT_EQ(reaper.Stop(), std::vector<pid_t>{slow});
  StopProcess(slow, 1000);
}

// A spawned child gets the options' variables over this process's environment, the rest
// inherited.
TEST(SpawnProcessTest, TheChildGetsTheGivenEnvironmentOverItsParents) {
  const std::string out = ::testing::TempDir() + "/spawn_environment.txt";
  std::filesystem::remove(out);
  ASSERT_EQ(::setenv("TESSERA_SPAWN_TEST_KEPT", "parent", 1), 0);
  ASSERT_EQ(::setenv("TESSERA_SPAWN_TEST_REPLACED", "parent", 1), 0);
  SpawnOptions options;
  options.environment = {{"TESSERA_SPAWN_TEST_REPLACED", "child"},
                         {"TESSERA_SPAWN_TEST_NEW", "a=b c"}};
  ASSERT_OK_AND_ASSIGN(const pid_t child,
                       SpawnProcess({"/bin/sh", "-c",
                                     "printf '%s|%s|%s|%s' \"$TESSERA_SPAWN_TEST_KEPT\" "
                                     "\"$TESSERA_SPAWN_TEST_REPLACED\" \"$TESSERA_SPAWN_TEST_NEW\" "
                                     "\"$(env | grep -c '^TESSERA_SPAWN_TEST_REPLACED=')\" > " +
                                         out},
                                    options));
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::unsetenv("TESSERA_SPAWN_TEST_KEPT");
  ::unsetenv("TESSERA_SPAWN_TEST_REPLACED");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(ReadFileText(out), "parent|child|a=b c|1");
}

TEST(SessionTest, TheTesseraBinaryIsLookedForInOrder) {
  BinarySearch search;
  search.places.env_bin_dir = "";  // set, it would be the only place (below)
  // The later places, each found once those before it are empty.
  search.present = {"/path-b/tessera"};
  EXPECT_EQ(*search.Find(), "/path-b/tessera");
  search.present.insert("/path-a/tessera");
  EXPECT_EQ(*search.Find(), "/path-a/tessera");
  search.present.insert("/usr/local/bin/tessera");
  EXPECT_EQ(*search.Find(), "/usr/local/bin/tessera");
  search.present.insert("/sdk/bin/tessera");
  EXPECT_EQ(*search.Find(), "/sdk/bin/tessera");
  search.present.insert("/exe-dir/tessera");
  EXPECT_EQ(*search.Find(), "/exe-dir/tessera");
  // The explicit choices come first: $TESSERA_BIN_DIR, then $TESSERA_BINARY, then the option.
  search.places.env_bin_dir = "/env-dir";
  search.present.insert("/env-dir/tessera");
  EXPECT_EQ(*search.Find(), "/env-dir/tessera");
  search.places.env_binary = "/somewhere/my-tessera";
  search.present.insert("/somewhere/my-tessera");
  EXPECT_EQ(*search.Find(), "/somewhere/my-tessera");
  search.places.flag = "/given/tessera";
  search.present.insert("/given/tessera");
  EXPECT_EQ(*search.Find(), "/given/tessera");
}

TEST(SessionTest, AnExplicitTesseraBinaryThatIsMissingIsTheError) {
  BinarySearch search;
  search.present = {"/exe-dir/tessera", "/path-a/tessera"};  // never used instead
  Result<std::string> bin_dir = search.Find();
  ASSERT_FALSE(bin_dir.ok());
  EXPECT_EQ(bin_dir.status().code(), StatusCode::kNotFound);
  EXPECT_NE(bin_dir.status().message().find(
                "$TESSERA_BIN_DIR is '/env-dir', but '/env-dir/tessera' is not an executable"),
            std::string::npos)
      << bin_dir.status().ToString();
  search.places.env_binary = "/nothing/tessera";
  Result<std::string> binary = search.Find();
  EXPECT_NE(binary.status().message().find("$TESSERA_BINARY '/nothing/tessera'"), std::string::npos)
      << binary.status().ToString();
  search.places.flag = "/not/here";
  Result<std::string> flag = search.Find();
  EXPECT_NE(flag.status().message().find("LocalClusterOptions::tessera_binary '/not/here'"),
            std::string::npos)
      << flag.status().ToString();
}

TEST(SessionTest, NoTesseraBinaryAnywhereNamesEveryPlaceAndTheFix) {
  BinarySearch search;
  search.places.env_bin_dir = "";
  Result<std::string> found = search.Find();
  ASSERT_FALSE(found.ok());
  EXPECT_EQ(found.status().code(), StatusCode::kNotFound);
  const std::string message = found.status().message();
  for (const char* part :
       {"$TESSERA_BIN_DIR (not set)", "/exe-dir/tessera (next to this executable)",
        "/sdk/bin/tessera (the installed SDK this program was built against)",
        "/usr/local/bin/tessera (the install prefix Tessera was configured with)",
        "the 2 directories of $PATH (/path-a::/path-b)", "cmake --install build --prefix P",
        "TESSERA_BIN_DIR=P/bin"}) {
    EXPECT_NE(message.find(part), std::string::npos) << part << "\n" << message;
  }
  // Programs built inside the project have no SDK directory: it is not listed.
  search.places.sdk_bin_dir = "";
  EXPECT_EQ(search.Find().status().message().find("installed SDK"), std::string::npos);
}

}  // namespace
}  // namespace tessera::testing
