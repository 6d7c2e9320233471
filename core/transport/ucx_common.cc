#include "core/transport/ucx_common.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <ucs/debug/log_def.h>

#include "core/logging.h"
#include "core/transport/ucx_info.h"

namespace tessera::detail {
namespace {

// The "ucx" logger, taken once and never released (a global, so reachable: not a leak): UCX
// may log while the process exits, after spdlog's registry is gone.
const std::shared_ptr<spdlog::logger>* ucx_logger = nullptr;

// UCX's own log lines (those UCX_LOG_LEVEL lets through: warnings and errors by default) go to
// the "ucx" logger, stamped and filtered like the process's other lines rather than printed by
// UCX in its own format. An error or warning stays one. Demoted to debug: the lines a flush (a
// graceful close's) writes when the peer's endpoint is already gone ("error during flush:
// Endpoint timeout", one per lane): every worker's log had four per endpoint at every cluster's
// end, where the workers close towards each other at once; a peer that dies mid-run is reported
// by the runtime itself (the failed pull or collective names it). Fatal lines also go on to
// UCX's own handler (which then aborts).
ucs_log_func_rc_t RouteUcxLog(const char* file, unsigned line, const char* /*function*/,
                              ucs_log_level_t level,
                              const ucs_log_component_config_t* /*component*/, const char* format,
                              va_list arguments) {
  char text[1024];
  va_list copy;
  va_copy(copy, arguments);
  std::vsnprintf(text, sizeof(text), format, copy);  // NOLINT(cert-err33-c): truncation is fine
  va_end(copy);
  const std::string_view message(text);
  spdlog::level::level_enum as = spdlog::level::debug;
  if (level <= UCS_LOG_LEVEL_ERROR) as = spdlog::level::err;
  if (level == UCS_LOG_LEVEL_WARN) as = spdlog::level::warn;
  if (as != spdlog::level::debug && message.find("error during flush") != std::string_view::npos) {
    as = spdlog::level::debug;
  }
  (*ucx_logger)->log(as, "{} ({}:{})", message, file, line);
  return level == UCS_LOG_LEVEL_FATAL ? UCS_LOG_FUNC_RC_CONTINUE : UCS_LOG_FUNC_RC_STOP;
}

}  // namespace

void RouteUcxLogging() {
  static std::once_flag routed;
  std::call_once(routed, [] {
    ucx_logger = new std::shared_ptr<spdlog::logger>(GetLogger("ucx"));  // NOLINT: kept
    ucs_log_push_handler(&RouteUcxLog);
  });
}

Result<UcxHandles> CreateUcxWorker(uint64_t features, const char* name, const char* transports,
                                   bool indirect_ids) {
  RouteUcxLogging();
  ucp_config_t* config = nullptr;
  TESSERA_UCX_RETURN_IF_ERROR(ucp_config_read(nullptr, nullptr, &config), "config read");
  // Endpoint ids on the wire go through UCX's table, not raw pointers: a message that arrives
  // for an endpoint this process already closed (a peer that was dropped, or one that lies) is
  // then discarded instead of read from freed memory. UCX does so by default only in
  // peer-failure mode; a flood of silent endpoints closed in a burst made the unchecked lookup
  // abort a test process.
  const std::pair<const char*, const char*> defaults[] = {{"TLS", transports},
                                                          {"PROTO_INDIRECT_ID", "on"}};
  for (const auto& [key, value] : defaults) {
    if (!indirect_ids && std::string_view(key) == "PROTO_INDIRECT_ID") continue;
    if (std::getenv(fmt::format("UCX_{}", key).c_str()) != nullptr) continue;  // the user's
    const ucs_status_t modified = ucp_config_modify(config, key, value);
    if (modified != UCS_OK) {
      ucp_config_release(config);
      return UcxError(fmt::format("config ({}={})", key, value), modified);
    }
  }
  UcxHandles handles;
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = features | UCP_FEATURE_WAKEUP;
  params.name = name;
  const ucs_status_t init = ucp_init(&params, config, &handles.context);
  ucp_config_release(config);
  TESSERA_UCX_RETURN_IF_ERROR(init, "init");
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucs_status_t status = ucp_worker_create(handles.context, &worker_params, &handles.worker);
  if (status == UCS_OK) status = ucp_worker_get_efd(handles.worker, &handles.event_fd);
  if (status != UCS_OK) {
    if (handles.worker != nullptr) ucp_worker_destroy(handles.worker);
    ucp_cleanup(handles.context);
    return UcxError("worker create", status);
  }
  return handles;
}

}  // namespace tessera::detail

namespace tessera {

std::string DescribeUcx() {
  const char* tls = std::getenv("UCX_TLS");
  const std::string transports =
      tls != nullptr ? fmt::format("UCX_TLS={}", tls) : std::string("UCX's choice but cma");
  Result<detail::UcxHandles> opened =
      detail::CreateUcxWorker(UCP_FEATURE_AM, "tessera-doctor", "^cma");
  if (!opened.ok()) {
    return fmt::format("UCX {}; no worker opens ({}): {}", ucp_get_version_string(), transports,
                       opened.status().message());
  }
  ucp_worker_destroy(opened->worker);
  ucp_cleanup(opened->context);
  return fmt::format("UCX {}; a worker opens (transports: {})", ucp_get_version_string(),
                     transports);
}

}  // namespace tessera
