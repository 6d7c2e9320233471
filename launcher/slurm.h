// Slurm: a cluster brought up inside a Slurm allocation (`tessera up --slurm`, in salloc or an
// sbatch script), its hosts read from the allocation and its processes started with srun.
//
// The allocation (SlurmAllocationFromEnvironment): SLURM_JOB_ID, the nodes from
// SLURM_JOB_NODELIST (hostlist syntax, "node[01-04,07],gpu-a[1-2]"; ExpandHostlist), and the
// CPUs per node from SLURM_JOB_CPUS_PER_NODE ("16(x3),8"). The cluster it becomes
// (SlurmClusterSpec): the head (the scheduler) on the allocation's first node, one set of
// workers on every node (its first too), named "slurm-<job id>".
//
// Starting processes (SrunShell, a RemoteShell): every command on a node is an srun step
// (`srun --overlap --nodes=1 --ntasks=1 --nodelist=NODE`). Slurm ends every process a step
// started when the step ends (proctrack/cgroup), so the processes `tessera start` starts run
// inside a step that lasts as long as they do: `tessera start ... --block` stays in the
// foreground until its processes exit, its srun is left running in the background (its output in
// a log file), and StartBlocking returns as soon as the command says its processes are up.
// `tessera down --slurm` stops the cluster through the head, and the steps end with their
// processes.
//
// Thread safety: the functions are pure; SrunShell is thread-safe.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "launcher/cluster_config.h"
#include "launcher/launcher.h"

namespace tessera::launcher {

// The host names of a Slurm hostlist, in order: comma-separated items, each a name with any
// number of bracketed ranges ("n[1-3,7]", "r[1-2]-n[01-02]"; numbers keep their zero padding).
// InvalidArgument naming the list and what is wrong (an unclosed bracket, a bad range, more
// than 65536 hosts).
Result<std::vector<std::string>> ExpandHostlist(std::string_view hostlist);

// The CPUs of each of `nodes` nodes from SLURM_JOB_CPUS_PER_NODE's syntax ("16(x3),8": three of
// 16, then one of 8). InvalidArgument when it does not describe exactly `nodes` nodes.
Result<std::vector<int>> ExpandCpusPerNode(std::string_view spec, size_t nodes);

struct SlurmAllocation {
  std::string job_id;
  std::vector<std::string> nodes;
  std::vector<int> cpus;  // per node; empty when Slurm did not say
};

// The allocation this process runs in, read through `getenv`. FailedPrecondition-like
// InvalidArgument, saying how to get one (salloc, sbatch), outside an allocation.
Result<SlurmAllocation> SlurmAllocationFromEnvironment(
    const std::function<std::optional<std::string>(const char*)>& getenv);

struct SlurmClusterOptions {
  int port = 6380;           // the scheduler's
  int workers_per_node = 1;  // CPU workers on each node
  int threads = 0;           // each worker's (0: the node's CPUs / workers_per_node)
  int64_t host_memory_mb = 8192;
  std::string session_root;  // on every node; empty: /tmp/tessera/<name>
  int join_timeout_s = 60;
};

// The cluster an allocation becomes (see the top of this file).
ClusterSpec SlurmClusterSpec(const SlurmAllocation& allocation, const SlurmClusterOptions& options);

struct SrunShellOptions {
  std::string srun_binary = "srun";
  // Where each blocking start's srun writes its output (<log_dir>/<host>-<n>.log).
  std::string log_dir;
};

// srun's argv for one step of `command` on `host` (see the top of this file).
std::vector<std::string> SrunArgv(const std::string& srun_binary, const std::string& host,
                                  const std::string& command);

// The line `tessera start --block` prints once its processes are up; StartBlocking waits for it.
inline constexpr std::string_view kBlockingStartedLine = "tessera start: up; holding";

class SrunShell final : public RemoteShell {
 public:
  explicit SrunShell(SrunShellOptions options) : options_(std::move(options)) {}
  // A step that runs `command` and ends (the user is ignored: steps run as the allocation's
  // owner). srun failing to start the step (exit 1 with srun's own "srun: error") is
  // Unavailable with its words.
  Result<CommandOutcome> Run(const std::string& host, const std::string& user,
                             const std::string& command, const std::string& input,
                             int timeout_ms) override;
  bool StartsBlock() const override { return true; }
  // A step running `command` (which ends in `tessera start ... --block`) in the background:
  // returns once its output has kBlockingStartedLine (the output so far, exit 0), or when the
  // step ended before that (its status and output), leaving the step running in the first case.
  // TimedOut (the step killed) past timeout_ms.
  Result<CommandOutcome> StartBlocking(const std::string& host, const std::string& user,
                                       const std::string& command, const std::string& input,
                                       int timeout_ms) override;

 private:
  SrunShellOptions options_;
};

}  // namespace tessera::launcher
