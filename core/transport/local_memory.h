// Single-copy transfers between processes on one host.
//
// A process reads another's memory directly (process_vm_readv): the bytes move once, copied by
// the reader alone, instead of through a shared-memory bounce buffer (two copies, both sides
// busy) or a socket. UCX's own CMA transport does the same but aborts the process when the
// peer dies mid-copy unless its peer-failure mode is on, which in UCX 1.13 costs shared memory;
// here a vanished peer is an error (ESRCH, EFAULT) like any other.
//
// Identity and permission: a process is named by its pid and the address of its probe word
// (ThisProcess). Before trusting a pid — another host's pid, or another container's, may name
// some unrelated local process — a reader checks that the probe word at that address reads back
// the magic value (CanReadMemoryOf). Reading needs ptrace permission: the same user, and under
// Yama's ptrace_scope 1 the target's consent, which ThisProcess gives (PR_SET_PTRACER_ANY).
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace tessera {

struct LocalProcess {
  int32_t pid = 0;
  uint64_t probe = 0;  // address of the probe word in that process
};

// This process's identity (and, on first call, the consent for same-user peers to read it).
LocalProcess ThisProcess();

// True when `peer` is a live process on this host whose memory this process may read.
bool CanReadMemoryOf(const LocalProcess& peer);

// Copies `bytes` from `address` in process `pid` into `into`. Returns 0, or the errno (ESRCH:
// the process is gone; EFAULT: the range is not mapped there; EPERM: not allowed).
int ReadMemoryOf(pid_t pid, uint64_t address, void* into, int64_t bytes);

}  // namespace tessera
