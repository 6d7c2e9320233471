// Cluster files (launcher/cluster_config.h): the YAML format and hostfiles, and that every
// error names the file, the line and what to change.
#include "launcher/cluster_config.h"

#include <filesystem>

#include <gtest/gtest.h>

namespace tessera::launcher {
namespace {

constexpr const char* kFull = R"(cluster_name: lab
head:
  address: 10.77.0.1
  port: 7000
nodes:
  - address: 10.77.0.2
    workers: 2
    threads: 1
    env: {OMP_NUM_THREADS: "1"}
  - address: 10.77.0.3
    gpus: 4
    user: alice
    host_memory_mb: 1024
ssh:
  user: root
  key: /keys/id
  port: 2222
  connect_timeout_s: 3
  options: ["Compression=no"]
setup_commands: ["mkdir -p /data", "true"]
env: {TESSERA_LOG_LEVEL: warn}
tessera_binary: /opt/tessera/bin/tessera
session_root: /var/tmp/t
join_timeout_s: 20
)";

TEST(ClusterConfigTest, ParsesEveryField) {
  Result<ClusterSpec> spec = ParseClusterYaml(kFull, "/etc/c.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->name, "lab");
  EXPECT_EQ(spec->head.address, "10.77.0.1");
  EXPECT_EQ(spec->head.port, 7000);
  ASSERT_EQ(spec->nodes.size(), 2u);
  EXPECT_EQ(spec->nodes[0].address, "10.77.0.2");
  EXPECT_EQ(spec->nodes[0].workers, 2);
  EXPECT_EQ(spec->nodes[0].threads, 1);
  EXPECT_EQ(spec->nodes[0].env.at("OMP_NUM_THREADS"), "1");
  EXPECT_EQ(spec->nodes[0].line, 6);
  EXPECT_EQ(spec->nodes[1].workers, 0);  // gpus alone: no CPU workers
  EXPECT_EQ(spec->nodes[1].gpus, 4);
  EXPECT_EQ(spec->nodes[1].user, "alice");
  EXPECT_EQ(spec->nodes[1].host_memory_mb, 1024);
  EXPECT_EQ(spec->ssh.user, "root");
  EXPECT_EQ(spec->ssh.key, "/keys/id");
  EXPECT_EQ(spec->ssh.port, 2222);
  EXPECT_EQ(spec->ssh.connect_timeout_s, 3);
  EXPECT_EQ(spec->ssh.options, std::vector<std::string>{"Compression=no"});
  EXPECT_EQ(spec->setup_commands.size(), 2u);
  EXPECT_EQ(spec->env.at("TESSERA_LOG_LEVEL"), "warn");
  EXPECT_EQ(spec->tessera_binary, "/opt/tessera/bin/tessera");
  EXPECT_EQ(spec->join_timeout_s, 20);
  EXPECT_EQ(spec->ExpectedWorkers(), 6);
  EXPECT_EQ(spec->HeadSessionDir(), "/var/tmp/t/lab-head");
  EXPECT_EQ(spec->NodeSessionDir(spec->nodes[0]), "/var/tmp/t/lab-node-10.77.0.2");
}

TEST(ClusterConfigTest, DefaultsAndNameFromFile) {
  Result<ClusterSpec> spec =
      ParseClusterYaml("head: {address: 10.0.0.1}\nnodes:\n  - address: n1\n", "/x/small.yml");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->name, "small");
  EXPECT_EQ(spec->head.port, 6380);
  EXPECT_EQ(spec->nodes[0].workers, 1);
  EXPECT_EQ(spec->tessera_binary, "");  // found on each host (FindTesseraScript)
  EXPECT_EQ(spec->ssh.port, 22);
}

// The message of parsing `text` as c.yaml, which must fail with InvalidArgument.
std::string YamlError(const std::string& text) {
  Result<ClusterSpec> spec = ParseClusterYaml(text, "c.yaml");
  EXPECT_FALSE(spec.ok());
  if (spec.ok()) return "";
  EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument);
  return spec.status().message();
}

TEST(ClusterConfigTest, ErrorsNameFileLineAndFix) {
  const std::string base = "head: {address: 10.0.0.1}\nnodes:\n  - address: 10.0.0.2\n";
  std::string message = YamlError(base + "  - adress: 10.0.0.3\n");
  EXPECT_NE(message.find("c.yaml:4: unknown key 'adress' in nodes[1]"), std::string::npos)
      << message;
  EXPECT_NE(message.find("address, workers"), std::string::npos) << message;

  message = YamlError(base + "  - workers: 2\n");
  EXPECT_NE(message.find("c.yaml:4: nodes[1] has no address; add `address:"), std::string::npos)
      << message;

  message = YamlError(base + "  - address: 10.0.0.3\n    workers: two\n");
  EXPECT_NE(message.find("c.yaml:5: nodes[1].workers is 'two', not a whole number"),
            std::string::npos)
      << message;

  message = YamlError(base + "  - address: 10.0.0.3\n    workers: -1\n");
  EXPECT_NE(message.find("c.yaml:5: nodes[1].workers is -1; it must be at least 0"),
            std::string::npos)
      << message;

  message = YamlError(base + "  - address: 10.0.0.3\n    workers: 0\n");
  EXPECT_NE(message.find("no workers and no gpus"), std::string::npos) << message;

  message = YamlError(base + "  - address: 10.0.0.2\n");
  EXPECT_NE(message.find("c.yaml:4: node 10.0.0.2 is listed twice (first at line 3)"),
            std::string::npos)
      << message;

  message = YamlError(base + "sssh: {user: root}\n");
  EXPECT_NE(message.find("c.yaml:4: unknown key 'sssh' in the cluster file"), std::string::npos)
      << message;

  message = YamlError("nodes:\n  - address: 10.0.0.2\n");
  EXPECT_NE(message.find("c.yaml:1: no head"), std::string::npos) << message;

  message = YamlError("head: {port: 1}\nnodes: [{address: a}]\n");
  EXPECT_NE(message.find("c.yaml:1: head has no address"), std::string::npos) << message;

  message = YamlError("head: {address: 10.0.0.1}\nnodes: []\n");
  EXPECT_NE(message.find("c.yaml:2: nodes must be a list of at least one node"), std::string::npos)
      << message;

  message = YamlError(base + "ssh: {port: 22x}\n");
  EXPECT_NE(message.find("c.yaml:4: ssh.port is '22x', not a whole number"), std::string::npos)
      << message;

  message = YamlError(base + "env: {1BAD: x}\n");
  EXPECT_NE(message.find("not an environment variable name"), std::string::npos) << message;

  message = YamlError(base + "  - address: 'a b; rm -rf /'\n");
  EXPECT_NE(message.find("is not a host name or IP address"), std::string::npos) << message;

  message = YamlError("head: {address: 10.0.0.1\nnodes: [\n");
  EXPECT_NE(message.find("c.yaml:"), std::string::npos) << message;
  EXPECT_NE(message.find("not valid YAML"), std::string::npos) << message;

  message = YamlError("");
  EXPECT_NE(message.find("c.yaml:1: the file is empty"), std::string::npos) << message;
}

TEST(ClusterConfigTest, Hostfile) {
  Result<ClusterSpec> spec = ParseHostfile(
      "# the lab\n\nworker-1 slots=4\n  worker-2   # one slot\n10.0.0.9 slots=2 # gpu box\n",
      "/etc/hosts.txt");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->name, "hosts");
  ASSERT_EQ(spec->nodes.size(), 3u);
  EXPECT_EQ(spec->nodes[0].address, "worker-1");
  EXPECT_EQ(spec->nodes[0].workers, 4);
  EXPECT_EQ(spec->nodes[1].workers, 1);
  EXPECT_EQ(spec->nodes[2].workers, 2);
  EXPECT_EQ(spec->nodes[2].line, 5);
  EXPECT_EQ(spec->head.address, "worker-1");  // the first host is the head
}

TEST(ClusterConfigTest, HostfileErrors) {
  Result<ClusterSpec> spec = ParseHostfile("a slots=2\nb slots=four\n", "hf");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("hf:2: slots 'four' is not a positive whole number"),
            std::string::npos)
      << spec.status().message();
  spec = ParseHostfile("a slots=0\n", "hf");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("hf:1: slots '0'"), std::string::npos);
  spec = ParseHostfile("a gpus=2\n", "hf");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("hf:1: unknown field 'gpus=2'"), std::string::npos);
  spec = ParseHostfile("# nothing\n\n", "hf");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("hf:1: no hosts"), std::string::npos);
  spec = ParseHostfile("a\nb\na slots=3\n", "hf");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("hf:3: node a is listed twice (first at line 1)"),
            std::string::npos)
      << spec.status().message();
}

TEST(ClusterConfigTest, LoadPicksFormatByExtension) {
  Result<ClusterSpec> missing = LoadClusterFile("/nonexistent/cluster.yaml");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/cluster.yaml"), std::string::npos);
  // A path, not std::string's operator+ on a literal: GCC 12 at -O1 warns falsely inside that
  // (-Warray-bounds, GCC bug 105329).
  const std::filesystem::path local3 =
      std::filesystem::path(TESSERA_SOURCE_DIR) / "examples/clusters/local3.yaml";
  Result<ClusterSpec> example = LoadClusterFile(local3.string());
  ASSERT_TRUE(example.ok()) << example.status().ToString();
  EXPECT_EQ(example->nodes.size(), 3u);
}

}  // namespace
}  // namespace tessera::launcher
