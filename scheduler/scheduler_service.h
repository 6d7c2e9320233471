// SchedulerService: the scheduler process's network shell around SchedulerCore.
//
// It listens on a TCP address, gives every accepted connection a participant id, feeds each
// received message to the core on one io thread (so the core needs no locks), delivers the
// core's outgoing messages, ticks the core for heartbeat checks, and stops when the core has
// been asked to shut down.
//
// Until the core accepts a connection's Hello the connection is pending (core/
// pending_connections.h): its frames are limited to `preauth_frame_bytes`, it is closed when it
// has not said Hello within the deadline, and at the caps on pending connections (per peer
// address, in all) the oldest pending one is closed for a newcomer. Admitted participants are
// never affected. It also serves the dashboard (dashboard/: the page, its JSON API and
// /metrics) on the same io thread, so the dashboard reads the core without locks.
#pragma once

#include <memory>
#include <string>

#include "core/pending_connections.h"
#include "core/rpc/address.h"
#include "core/settings.h"
#include "core/status.h"
#include "scheduler/scheduler_core.h"

namespace tessera {

struct SchedulerServiceOptions {
  rpc::Address address = rpc::Address::Tcp("127.0.0.1", 0);  // port 0: any free port
  // Also listen on this Unix socket (processes on the same machine: no TCP stack). Empty: no.
  std::string unix_socket;
  SchedulerOptions core;
  // Bounds on connections that have not said Hello yet (the preauth_* settings).
  PendingLimits preauth;
  uint32_t preauth_frame_bytes = 64 * 1024;
  // How long the io thread keeps polling after its last message before it sleeps (the
  // idle_spin_us setting; core/rpc/io_loop.h).
  int64_t idle_spin_us = Settings{}.idle_spin_us;
  // When set, the bound address is written here (atomically) once the scheduler listens, so a
  // launcher can find a scheduler started on port 0.
  std::string address_file;
  // The dashboard: HTTP on dashboard_host:dashboard_port (0: any free port), guarded by the
  // cluster token (core.token). Negative: no dashboard.
  std::string dashboard_host = "127.0.0.1";
  int dashboard_port = -1;
  // When set (and there is a dashboard), its HOST:PORT is written here (atomically) before
  // address_file, so whoever waits for the address file finds the dashboard's too.
  std::string dashboard_file;
};

class SchedulerService {
 public:
  // Unavailable naming the address when it cannot listen.
  static Result<std::unique_ptr<SchedulerService>> Start(const SchedulerServiceOptions& options);
  virtual ~SchedulerService() = default;
  virtual const rpc::Address& address() const = 0;
  // HOST:PORT of the dashboard; empty when there is none.
  virtual std::string dashboard_address() const = 0;
  // Blocks until a shutdown was requested (by `tessera stop` or a driver) or Stop() was called.
  virtual void Wait() = 0;
  virtual void Stop() = 0;
};

}  // namespace tessera
