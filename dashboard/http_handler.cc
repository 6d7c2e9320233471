#include "dashboard/http_handler.h"

#include <charconv>

#include "core/session_logs.h"
#include "core/status.h"
#include "dashboard/api_json.h"
#include "dashboard/assets.h"
#include "dashboard/prometheus.h"

namespace tessera::dashboard {

namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string PercentDecode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size() && HexDigit(text[i + 1]) >= 0 &&
        HexDigit(text[i + 2]) >= 0) {
      out += static_cast<char>(HexDigit(text[i + 1]) * 16 + HexDigit(text[i + 2]));
      i += 2;
    } else if (text[i] == '+') {
      out += ' ';
    } else {
      out += text[i];
    }
  }
  return out;
}

// Constant time in the length of `given` for a fixed `expected` length: no early exit on the
// first differing byte.
bool TokenEquals(const std::string& given, const std::string& expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i] ^ expected[i % expected.size()]);
  }
  return diff == 0;
}

std::string PathOf(const std::string& target) { return target.substr(0, target.find('?')); }

HttpResponse Text(int status, std::string body) {
  return {.status = status, .content_type = "text/plain; charset=utf-8", .body = std::move(body)};
}

HttpResponse Json(std::string body) {
  return {.status = 200, .content_type = "application/json", .body = std::move(body)};
}

constexpr std::string_view kLogPrefix = "/api/logs/";
constexpr int kDefaultLogLines = 200;
constexpr int kMostLogLines = 100'000;
constexpr int64_t kMostLogBytes = int64_t{1} << 20;

}  // namespace

HttpResponse HttpHandler::Log(const std::string& name, const std::string& lines_text) const {
  const std::string dir = source_->SessionDir();
  if (dir.empty()) return Text(404, "this scheduler has no session directory\n");
  int lines = kDefaultLogLines;
  if (!lines_text.empty()) {
    const auto [end, error] =
        std::from_chars(lines_text.data(), lines_text.data() + lines_text.size(), lines);
    if (error != std::errc() || end != lines_text.data() + lines_text.size() || lines < 0 ||
        lines > kMostLogLines) {
      return Text(400, fmt::format("lines must be a whole number from 0 to {}\n", kMostLogLines));
    }
  }
  Result<SessionLog> log = FindSessionLog(dir, name);
  if (!log.ok()) {
    return Text(log.status().code() == StatusCode::kInvalidArgument ? 400 : 404,
                log.status().message() + "\n");
  }
  Result<std::string> tail = TailOfFile(log->file, lines, kMostLogBytes);
  if (!tail.ok()) return Text(404, tail.status().message() + "\n");
  // Logs are bytes: the browser reads them as UTF-8 (invalid sequences shown replaced).
  return {.status = 200, .content_type = "text/plain; charset=utf-8", .body = *std::move(tail)};
}

std::string QueryValue(const std::string& target, const std::string& key) {
  const size_t question = target.find('?');
  if (question == std::string::npos) return "";
  std::string_view query(target);
  query.remove_prefix(question + 1);
  while (!query.empty()) {
    const size_t amp = query.find('&');
    std::string_view pair = query.substr(0, amp);
    const size_t eq = pair.find('=');
    if (PercentDecode(pair.substr(0, eq)) == key) {
      return eq == std::string_view::npos ? "" : PercentDecode(pair.substr(eq + 1));
    }
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return "";
}

std::string CookieValue(const std::string& header, const std::string& name) {
  std::string_view rest(header);
  while (!rest.empty()) {
    const size_t semi = rest.find(';');
    std::string_view pair = rest.substr(0, semi);
    while (!pair.empty() && pair.front() == ' ') pair.remove_prefix(1);
    const size_t eq = pair.find('=');
    if (eq != std::string_view::npos && pair.substr(0, eq) == name) {
      return std::string(pair.substr(eq + 1));
    }
    if (semi == std::string_view::npos) break;
    rest.remove_prefix(semi + 1);
  }
  return "";
}

HttpHandler::HttpHandler(std::string token, DashboardSource* source)
    : token_(std::move(token)), source_(source) {
  TESSERA_CHECK(!token_.empty(), "the dashboard needs the cluster token");
}

bool HttpHandler::Authorized(const HttpRequest& request, const std::string& query_token) const {
  constexpr std::string_view kBearer = "Bearer ";
  if (request.authorization.starts_with(kBearer) &&
      TokenEquals(request.authorization.substr(kBearer.size()), token_)) {
    return true;
  }
  const std::string cookie = CookieValue(request.cookie, kTokenCookie);
  if (!cookie.empty() && TokenEquals(cookie, token_)) return true;
  return !query_token.empty() && TokenEquals(query_token, token_);
}

HttpResponse HttpHandler::Handle(const HttpRequest& request) const {
  const std::string query_token = QueryValue(request.target, "token");
  if (!Authorized(request, query_token)) {
    HttpResponse refused = Text(401, "unauthorized: this dashboard needs the cluster token\n");
    refused.headers.emplace_back("WWW-Authenticate", "Bearer realm=\"tessera\"");
    return refused;
  }
  if (request.method != "GET" && request.method != "HEAD") {
    HttpResponse refused = Text(405, "method not allowed\n");
    refused.headers.emplace_back("Allow", "GET, HEAD");
    return refused;
  }
  const std::string path = PathOf(request.target);
  const Asset* asset = FindAsset(path);
  if (asset != nullptr && !query_token.empty()) {
    // The page was opened with ?token=: keep it in a cookie, not in the address bar.
    HttpResponse redirect = Text(303, "see " + path + "\n");
    redirect.headers.emplace_back("Location", path);
    redirect.headers.emplace_back("Set-Cookie", std::string(kTokenCookie) + "=" + token_ +
                                                    "; Path=/; HttpOnly; SameSite=Strict");
    return redirect;
  }
  if (asset != nullptr) {
    return {.status = 200,
            .content_type = std::string(asset->content_type),
            .body = std::string(asset->body)};
  }
  if (path == "/api/cluster") return Json(ClusterJson(source_->Cluster()));
  if (path == "/api/job") return Json(JobsJson(source_->Jobs()));
  if (path == "/api/timeline") return Json(TimelineJson(source_->Timeline()));
  if (path == "/api/waits") return Json(WaitsJson(source_->Cluster()));
  if (path == "/api/logs") {
    const std::string dir = source_->SessionDir();
    return Json(LogsJson(dir, dir.empty() ? std::vector<SessionLog>{} : ListSessionLogs(dir)));
  }
  if (path.starts_with(kLogPrefix))
    return Log(PercentDecode(path.substr(kLogPrefix.size())), QueryValue(request.target, "lines"));
  if (path == "/metrics") {
    return {.status = 200,
            .content_type = std::string(kPrometheusContentType),
            .body = PrometheusText(source_->Cluster(), source_->Jobs())};
  }
  return Text(404, "not found\n");
}

}  // namespace tessera::dashboard
