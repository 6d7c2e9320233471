// HttpHandler: the dashboard's routes and its token check, free of sockets.
//
// The HTTP server (http_server.h) parses a request into an HttpRequest and writes back the
// HttpResponse; everything a test needs to check (refusals, routes, bodies) happens here.
//
// Routes (GET or HEAD; anything else is 405, once the token was checked):
//   /                  the page (assets/index.html), then /dashboard.js and /dashboard.css
//   /api/cluster       nodes and workers: memory tiers, tasks, bytes moved, latest run reports
//   /api/job           every job's step history: loss, step time, tokens/s or samples/s
//   /api/timeline      recent spans of work per worker
//   /api/waits         per worker: what it runs or waits for, and on whom
//   /api/logs          the scheduler's session's logs by name (core/session_logs.h)
//   /api/logs/NAME     the end of one, as text (?lines=N: its last N lines, 200 by default,
//                      within 1 MiB; 0: all of that); 404 naming the logs there when unknown
//   /metrics           Prometheus text (prometheus.h)
//   anything else      404
//
// The token: every route needs the cluster's token, given as `Authorization: Bearer <token>`,
// as the cookie `tessera_token` (set by the server), or once as `?token=<token>` in the URL. A
// page opened with ?token= is redirected (303) to the same path without it, with the cookie set
// (HttpOnly, SameSite=Strict), so the token does not stay in the address bar or the history.
// Without a valid token the answer is 401 and a fixed body: nothing about the cluster, and no
// hint whether a route exists. Tokens are compared in constant time. Like the control plane,
// there is no TLS: the token keeps out processes that do not have it, not someone reading the
// wire.
//
// Thread safety: Handle calls the source, so it runs where the source may be read (the
// scheduler's io thread).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "dashboard/dashboard_state.h"

namespace tessera::dashboard {

struct HttpRequest {
  std::string method;         // "GET", ...
  std::string target;         // path and query, as sent: "/api/job?token=..."
  std::string cookie;         // the Cookie header, or empty
  std::string authorization;  // the Authorization header, or empty
};

struct HttpResponse {
  int status = 200;
  std::string content_type;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // besides Content-Type
};

inline constexpr const char* kTokenCookie = "tessera_token";

class HttpHandler {
 public:
  // `token` is the cluster's; `source` must outlive the handler. REQUIRES: token not empty.
  HttpHandler(std::string token, DashboardSource* source);

  HttpResponse Handle(const HttpRequest& request) const;

 private:
  bool Authorized(const HttpRequest& request, const std::string& query_token) const;
  // /api/logs/<name>?lines=<lines_text>.
  HttpResponse Log(const std::string& name, const std::string& lines_text) const;

  const std::string token_;
  DashboardSource* source_;
};

// Splits "path?query" and returns the value of `key` in the query, percent-decoded ("" when
// absent). Exposed for tests.
std::string QueryValue(const std::string& target, const std::string& key);
// The value of cookie `name` in a Cookie header ("" when absent).
std::string CookieValue(const std::string& header, const std::string& name);

}  // namespace tessera::dashboard
