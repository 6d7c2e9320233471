// CPU sets: which cores a process may run on (its affinity), as a list the way Linux writes one
// ("0-3,8,10-11"). A worker reports its set when it joins (`tessera status` shows it); a local
// cluster started with bind_cores gives each worker a set of its own (`tessera worker --cpus`),
// as DeepSpeed's --bind_cores_to_rank does. Workers whose sets overlap on one host share those
// cores: the plan search's simulation of such workers shares the cores among the workers of each
// group (ComputeSharing, planner/step_simulation.h), not the whole machine among all of them.
//
// Thread safety: free functions; BindProcessTo changes every thread of the process.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace tessera {

// "0-3,8" -> {0, 1, 2, 3, 8}: ascending, without repeats. InvalidArgument naming the list and
// what is wrong in it (an empty list, a range that runs backwards, a CPU past 4095, a stray
// character).
Result<std::vector<int>> ParseCpuList(std::string_view list);
// The inverse: ascending CPUs as ranges ("0-3,8"); "" for none.
std::string FormatCpuList(const std::vector<int>& cpus);

// The CPUs this process may run on now (sched_getaffinity). Internal on a kernel failure.
Result<std::vector<int>> ProcessCpus();

// Restricts every thread of this process to `cpus` (and threads it starts later, which inherit
// the set). InvalidArgument when `cpus` is empty or names a CPU this process may not use (offline,
// or outside its cgroup's cpuset; the error says where the process runs now).
Status BindProcessTo(const std::vector<int>& cpus);

// Each of `workers` workers of `threads` threads its own cores out of `available`, in order:
// worker i the `threads` CPUs from position i * threads. With more threads in all than CPUs the
// positions wrap around, so workers share cores evenly (4 workers of one thread on 2 CPUs: the
// first and third on the first CPU, the second and fourth on the second). InvalidArgument for no
// CPUs, workers < 1 or threads < 1.
Result<std::vector<std::vector<int>>> AssignCores(const std::vector<int>& available, int workers,
                                                  int threads);

// The `tessera worker --cpus` lists of workers first .. first + count - 1 of a host's workers
// bound to cores: AssignCores over this process's CPUs, each set written as a list. Errors:
// ProcessCpus's and AssignCores's.
Result<std::vector<std::string>> WorkerCpuLists(int first, int count, int threads);

}  // namespace tessera
