// Cluster files: what `tessera up/down/attach` read. A pure module (no processes, no network):
// text in, a checked ClusterSpec or an error out.
//
// Two formats:
//
// YAML (a file ending .yaml or .yml):
//
//   cluster_name: local3              # names the state file and the session dirs (default: the
//                                     # file name without extension); [A-Za-z0-9_.-]
//   head:
//     address: 10.77.0.1              # required: where the scheduler listens (an IP it can bind)
//     port: 6380                      # default 6380
//   nodes:                            # at least one
//     - address: 10.77.0.2            # required: the host ssh reaches (and its workers' IP)
//       workers: 2                    # CPU workers (default 1 when gpus is 0)
//       gpus: 0                       # GPU workers (this build: CPU only; reported as failing)
//       threads: 1                    # per worker; 0 (default): all cores
//       host_memory_mb: 4096          # per worker
//       user: root                    # overrides ssh.user for this node
//       env: {OMP_NUM_THREADS: "1"}   # added to (and overriding) the cluster's env
//   ssh:
//     user: root                      # default: ssh's own ($USER)
//     key: /root/.ssh/id_ed25519      # default: ssh's own
//     port: 22
//     connect_timeout_s: 10
//     options: ["Compression=no"]     # more `-o` options
//   setup_commands: ["mkdir -p /data"]  # run on every host (head and nodes) before starting
//   env: {TESSERA_LOG_LEVEL: info}      # set for every process the launcher starts
//   tessera_binary: /opt/tessera/bin/tessera   # on the hosts; default: the path `tessera up`
//                                     # runs from, where it exists on the host, else `tessera`
//                                     # on its PATH
//   session_root: /tmp/tessera        # where each host keeps its session dir
//   join_timeout_s: 60                # how long `up` waits for every worker to join
//
// A DeepSpeed-style hostfile (any other name): one host per line, `host slots=N` (N CPU
// workers; `slots` omitted: 1), `#` comments and blank lines ignored. The first host is the head
// too; ssh settings come from ssh's defaults (~/.ssh/config) or the command line.
//
// Every error is InvalidArgument and reads "<file>:<line>: <what is wrong>; <what to change>".
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace tessera::launcher {

using EnvironmentMap = std::map<std::string, std::string>;

struct SshSettings {
  std::string user;  // empty: ssh's default
  std::string key;   // empty: ssh's default identities
  int port = 22;
  int connect_timeout_s = 10;
  std::vector<std::string> options;  // each passed as `-o <option>`
};

struct NodeSpec {
  std::string address;
  int workers = 1;  // CPU workers
  int gpus = 0;
  int threads = 0;  // per worker; 0: the host's cores
  int64_t host_memory_mb = 4096;
  std::string user;  // empty: SshSettings::user
  EnvironmentMap env;
  int line = 0;  // where the node is declared, for messages
};

struct HeadSpec {
  std::string address;
  int port = 6380;
};

struct ClusterSpec {
  std::string name;
  std::string file;  // where it was read from
  HeadSpec head;
  std::vector<NodeSpec> nodes;
  SshSettings ssh;
  std::vector<std::string> setup_commands;
  EnvironmentMap env;
  std::string tessera_binary;  // empty: found on each host (FindTesseraScript)
  std::string session_root = "/tmp/tessera";
  int join_timeout_s = 60;

  // Workers expected on all nodes together.
  int ExpectedWorkers() const;
  // This host's session directory: <session_root>/<name>-head, or -node-<address>. Distinct per
  // host even when hosts share a file system; the pattern `tessera down` looks for.
  std::string HeadSessionDir() const;
  std::string NodeSessionDir(const NodeSpec& node) const;
};

// Parses YAML text; `file` names it in errors and its stem is the default cluster name.
Result<ClusterSpec> ParseClusterYaml(std::string_view text, const std::string& file);
// Parses a hostfile.
Result<ClusterSpec> ParseHostfile(std::string_view text, const std::string& file);
// Reads `path` and parses it by its extension (.yaml/.yml: YAML; else a hostfile). NotFound
// naming the path when it cannot be read.
Result<ClusterSpec> LoadClusterFile(const std::string& path);

}  // namespace tessera::launcher
