// A session's logs by the names users know them by (core/session_logs.h): the listing, the
// lookup, the tail of a file, and the link a worker makes to its own log.
#include "core/session_logs.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "test_util.h"

namespace tessera::testing {
namespace {

std::string FreshDir(const std::string& name) {
  std::string dir = TempPath("session_logs_test_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::vector<std::string> Names(const std::vector<SessionLog>& logs) {
  std::vector<std::string> names;
  names.reserve(logs.size());
  for (const SessionLog& log : logs) names.push_back(log.name);
  return names;
}

TEST(SessionLogsTest, ListedByTheNamesStatusShows) {
  const std::string dir = FreshDir("list");
  for (const char* file :
       {"worker-1.log", "scheduler.log", "worker-0.log", "worker-2.log", "worker-9-0.log"}) {
    std::ofstream(dir + "/" + file) << file << "\n";
  }
  std::ofstream(dir + "/token") << "t\n";  // not a log
  std::filesystem::create_symlink("worker-0.log", dir + "/worker12.log");
  std::filesystem::create_symlink("worker-2.log", dir + "/worker3.log");
  std::filesystem::create_symlink("gone.log", dir + "/worker4.log");  // dangling: skipped
  const std::vector<SessionLog> logs = ListSessionLogs(dir);
  EXPECT_EQ(Names(logs), (std::vector<std::string>{"scheduler", "worker3", "worker12", "worker-1",
                                                   "worker-9-0"}));
  ASSERT_EQ(logs.size(), 5u);
  EXPECT_EQ(std::filesystem::path(logs[1].file).filename(), "worker-2.log");
  EXPECT_EQ(logs[1].bytes, static_cast<int64_t>(std::string("worker-2.log\n").size()));
  EXPECT_GT(logs[1].modified_unix_s, 1'600'000'000);
  EXPECT_TRUE(ListSessionLogs(dir + "/missing").empty());
  std::filesystem::remove_all(dir);
}

TEST(SessionLogsTest, FoundByNameOrFileElseTheNamesAreListed) {
  const std::string dir = FreshDir("find");
  std::ofstream(dir + "/scheduler.log") << "s\n";
  std::ofstream(dir + "/worker-0.log") << "w\n";
  std::filesystem::create_symlink("worker-0.log", dir + "/worker2.log");
  for (const char* name : {"worker2", "worker2.log", "worker-0", "worker-0.log"}) {
    Result<SessionLog> log = FindSessionLog(dir, name);
    ASSERT_TRUE(log.ok()) << name << ": " << log.status().ToString();
    EXPECT_EQ(log->name, "worker2") << name;
    EXPECT_EQ(std::filesystem::path(log->file).filename(), "worker-0.log");
  }
  Result<SessionLog> missing = FindSessionLog(dir, "worker7");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no log named 'worker7' in the session " + dir +
                                            ": it has scheduler, worker2"),
            std::string::npos)
      << missing.status().message();
  EXPECT_NE(missing.status().message().find("another host"), std::string::npos);
  Result<SessionLog> path = FindSessionLog(dir, "../etc/passwd");
  ASSERT_FALSE(path.ok());
  EXPECT_EQ(path.status().code(), StatusCode::kInvalidArgument);
  const std::string empty = FreshDir("empty");
  EXPECT_NE(FindSessionLog(empty, "scheduler").status().message().find("holds no logs"),
            std::string::npos);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(empty);
}

TEST(SessionLogsTest, TheTailIsTheLastLinesWithinTheBytes) {
  const std::string dir = FreshDir("tail");
  const std::string file = dir + "/a.log";
  std::ofstream(file) << "one\ntwo\nthree\nfour\n";
  EXPECT_EQ(*TailOfFile(file, 2, 0), "three\nfour\n");
  EXPECT_EQ(*TailOfFile(file, 0, 0), "one\ntwo\nthree\nfour\n");
  EXPECT_EQ(*TailOfFile(file, 10, 0), "one\ntwo\nthree\nfour\n");
  // 12 bytes from the end start inside "two": that partial line is dropped.
  EXPECT_EQ(*TailOfFile(file, 0, 12), "three\nfour\n");
  std::ofstream(file) << "no newline\nat the end";
  EXPECT_EQ(*TailOfFile(file, 1, 0), "at the end");
  Result<std::string> missing = TailOfFile(dir + "/none.log", 5, 0);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(dir + "/none.log"), std::string::npos);
  std::filesystem::remove_all(dir);
}

// A worker links the file its standard error goes to under its id; a terminal or pipe is left.
TEST(SessionLogsTest, AProcessLinksItsOwnLogUnderAName) {
  const std::string dir = FreshDir("own");
  const std::string log = dir + "/worker-0.log";
  const int file = ::open(log.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
  ASSERT_GE(file, 0);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(file, STDERR_FILENO);
  const Status first = LinkOwnLogAs("worker7");
  const Status again = LinkOwnLogAs("worker7");  // replaced, not an error
  const Status other = LinkOwnLogAs("worker9");  // a restarted scheduler's new id
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(file);
  EXPECT_TRUE(first.ok()) << first.ToString();
  EXPECT_TRUE(again.ok()) << again.ToString();
  EXPECT_TRUE(other.ok()) << other.ToString();
  EXPECT_EQ(std::filesystem::read_symlink(dir + "/worker7.log"), "worker-0.log");
  EXPECT_EQ(std::filesystem::read_symlink(dir + "/worker9.log"), "worker-0.log");
  // The newest link names the file in the listing.
  EXPECT_EQ(Names(ListSessionLogs(dir)), std::vector<std::string>{"worker9"});
  // Standard error on a pipe: nothing made.
  int pipe_ends[2];
  ASSERT_EQ(::pipe(pipe_ends), 0);
  const int kept = ::dup(STDERR_FILENO);
  ::dup2(pipe_ends[1], STDERR_FILENO);
  const Status piped = LinkOwnLogAs("worker8");
  ::dup2(kept, STDERR_FILENO);
  ::close(kept);
  ::close(pipe_ends[0]);
  ::close(pipe_ends[1]);
  EXPECT_TRUE(piped.ok());
  EXPECT_FALSE(std::filesystem::exists(dir + "/worker8.log"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera::testing
