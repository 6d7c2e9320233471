// What both UCX users (the data plane, the peer transport) share: errors, and creating a context
// with its worker. Internal to core/transport.
#pragma once

#include <string_view>

#include <ucp/api/ucp.h>

#include "core/checks.h"
#include "core/status.h"

namespace tessera::detail {

// Unavailable: "UCX <what> failed: <UCX's words> (at file:line)" (core/checks.h).
inline Status UcxError(std::string_view what, ucs_status_t status,
                       const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return Unavailable("UCX {} failed: {} (at {})", what, ucs_status_string(status),
                     CallSite(file, line));
}

#define TESSERA_UCX_RETURN_IF_ERROR(call, what)                                       \
  do {                                                                                \
    const ucs_status_t ucx_status_ = (call);                                          \
    if (ucx_status_ != UCS_OK) return ::tessera::detail::UcxError(what, ucx_status_); \
  } while (0)

// UCX's log lines into the "ucx" logger (core/logging.h), once per process; CreateUcxWorker
// calls it.
void RouteUcxLogging();

// A UCX context and a single-threaded worker with a wakeup fd.
struct UcxHandles {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int event_fd = -1;
};

// `transports` becomes UCX_TLS unless the user set UCX_TLS; with `indirect_ids` (the data
// plane, which strangers may reach) endpoint ids are indirect (UCX_PROTO_INDIRECT_ID=on) unless
// the user set that. Not for the collectives' workers: UCX 1.13 then asserts when a worker whose
// collective was aborted mid-flight is destroyed with its requests outstanding. On error nothing
// is left to free.
Result<UcxHandles> CreateUcxWorker(uint64_t features, const char* name, const char* transports,
                                   bool indirect_ids = false);

}  // namespace tessera::detail
