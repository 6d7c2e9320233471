#include "core/cpu_set.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

namespace tessera {
namespace {

constexpr int kMaxCpu = 4095;

// The CPU number at the front of `rest`, which it consumes; -1 when there is none.
int TakeNumber(std::string_view& rest) {
  int value = -1;
  size_t used = 0;
  while (used < rest.size() && rest[used] >= '0' && rest[used] <= '9') {
    value = (value < 0 ? 0 : value * 10) + (rest[used] - '0');
    if (value > kMaxCpu) return kMaxCpu + 1;
    ++used;
  }
  rest.remove_prefix(used);
  return value;
}

}  // namespace

Result<std::vector<int>> ParseCpuList(std::string_view list) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument("CPU list '{}': {} (write CPUs and ranges such as 0-3,8)", list, why);
  };
  std::set<int> cpus;
  std::string_view rest = list;
  while (true) {
    const int first = TakeNumber(rest);
    if (first < 0) return bad(rest.empty() ? "a CPU is missing" : "expected a CPU number");
    int last = first;
    if (!rest.empty() && rest.front() == '-') {
      rest.remove_prefix(1);
      last = TakeNumber(rest);
      if (last < 0) return bad("a range has no end");
    }
    if (first > kMaxCpu || last > kMaxCpu) return bad(fmt::format("CPUs end at {}", kMaxCpu));
    if (last < first) return bad(fmt::format("the range {}-{} runs backwards", first, last));
    for (int cpu = first; cpu <= last; ++cpu) cpus.insert(cpu);
    if (rest.empty()) break;
    if (rest.front() != ',') return bad(fmt::format("unexpected '{}'", rest.front()));
    rest.remove_prefix(1);
  }
  return std::vector<int>(cpus.begin(), cpus.end());
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out;
}

Result<std::vector<int>> ProcessCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) {
    return Internal("sched_getaffinity: {}", std::strerror(errno));
  }
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

Status BindProcessTo(const std::vector<int>& cpus) {
  if (cpus.empty()) return InvalidArgument("binding to CPUs: the list is empty");
  TESSERA_ASSIGN_OR_RETURN(const std::vector<int> before, ProcessCpus());
  const auto refused = [&](const std::vector<int>& now) {
    return InvalidArgument(
        "binding to CPUs {}: not every one is a CPU this process may run on (it {} on {}); pick "
        "online CPUs its cgroup allows (nproc --all, /sys/fs/cgroup/cpuset.cpus.effective)",
        FormatCpuList(cpus), now == before ? "still runs" : "was left", FormatCpuList(now));
  };
  if (cpus.back() >= CPU_SETSIZE) return refused(before);
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) CPU_SET(cpu, &set);
  // Every thread there is (sched_setaffinity sets one thread's); new ones inherit their
  // creator's.
  // The kernel keeps the CPUs of a set it may use (none: EINVAL), so the result is checked.
  const auto bind = [&](pid_t tid) -> Status {
    if (::sched_setaffinity(tid, sizeof(set), &set) == 0 || errno == ESRCH) return Status::Ok();
    if (errno == EINVAL) return refused(before);
    return Internal("sched_setaffinity({}) of thread {}: {}", FormatCpuList(cpus), tid,
                    std::strerror(errno));
  };
  TESSERA_RETURN_IF_ERROR(bind(0));  // this thread first: a refused set changes nothing
  DIR* tasks = ::opendir("/proc/self/task");
  if (tasks != nullptr) {
    Status status = Status::Ok();
    while (dirent* entry = ::readdir(tasks)) {
      if (entry->d_name[0] == '.') continue;
      const Status bound = bind(static_cast<pid_t>(std::strtol(entry->d_name, nullptr, 10)));
      if (status.ok()) status = bound;
    }
    ::closedir(tasks);
    TESSERA_RETURN_IF_ERROR(status);
  }
  TESSERA_ASSIGN_OR_RETURN(const std::vector<int> now, ProcessCpus());
  return now == cpus ? Status::Ok() : refused(now);
}

Result<std::vector<std::vector<int>>> AssignCores(const std::vector<int>& available, int workers,
                                                  int threads) {
  if (available.empty()) return InvalidArgument("assigning cores: no CPUs to assign");
  if (workers < 1 || threads < 1) {
    return InvalidArgument("assigning cores to {} worker(s) of {} thread(s): both must be >= 1",
                           workers, threads);
  }
  std::vector<std::vector<int>> sets(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    std::set<int> cpus;
    for (int t = 0; t < threads; ++t) {
      const size_t position = static_cast<size_t>(w * threads + t) % available.size();
      cpus.insert(available[position]);
    }
    sets[static_cast<size_t>(w)].assign(cpus.begin(), cpus.end());
  }
  return sets;
}

Result<std::vector<std::string>> WorkerCpuLists(int first, int count, int threads) {
  TESSERA_ASSIGN_OR_RETURN(const std::vector<int> available, ProcessCpus());
  TESSERA_ASSIGN_OR_RETURN(const std::vector<std::vector<int>> sets,
                           AssignCores(available, first + count, threads));
  std::vector<std::string> lists;
  for (size_t i = static_cast<size_t>(first); i < sets.size(); ++i) {
    lists.push_back(FormatCpuList(sets[i]));
  }
  return lists;
}

}  // namespace tessera
