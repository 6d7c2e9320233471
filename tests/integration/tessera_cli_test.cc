// The `tessera` command as an operator uses it: start a head and workers, look, stop.
#include <filesystem>
#include <fstream>

#include "test_util.h"

namespace tessera::testing {
namespace {

ProcessResult Tessera(const std::string& arguments) { return RunBinary("tessera", arguments); }

std::string ReadLine(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

TEST(TesseraCliTest, StartStatusStop) {
  const std::string session = ::testing::TempDir() + "/tessera_cli_session";
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
