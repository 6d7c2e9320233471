// libFuzzer target: the dashboard's HTTP request handling (dashboard/http_parse.h,
// dashboard/http_handler.h) and what it renders.
//
// An input's first byte picks the mode:
//   parse (even)    the request's bytes go through Boost.Beast's parser with the server's limits
//                   (ParseHttpRequest, as the server reads a socket), then to the handler.
//   fields (odd)    the method, target, Cookie and Authorization come straight from the input
//                   (split at '\n'), so the handler's own parsing (the query string, percent
//                   escapes, cookies, the token check) is reached without a valid HTTP request.
// In both, the snapshot the handler renders (workers' host names and waits, job names, span
// names, figures including NaN and infinities) is drawn from the input's tail: those strings
// reach the scheduler from the wire (Hello, heartbeats, JobProgress), so the JSON and Prometheus
// renderers get arbitrary bytes, invalid UTF-8 included.
//
// Findings: crashes, sanitizer reports, and any exception escaping the handler (it would end the
// scheduler's io thread). The seeds are requests for every route, with the token given each way,
// and refused ones.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "dashboard/http_handler.h"
#include "dashboard/http_parse.h"
#include "fuzz/fuzz_util.h"

namespace tessera::fuzz {
namespace {

using dashboard::HttpRequest;

constexpr const char* kToken = "0123456789abcdef";

// The dashboard's figures, drawn from the input.
class FuzzedSource : public dashboard::DashboardSource {
 public:
  explicit FuzzedSource(FuzzedDataProvider& in) : in_(in) {}

  dashboard::ClusterView Cluster() override {
    dashboard::ClusterView view;
    view.session_dir = in_.ConsumeRandomLengthString(16);
    view.uptime_s = in_.ConsumeFloatingPoint<double>();
    const int workers = in_.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < workers; ++i) {
      dashboard::WorkerView& w = view.workers.emplace_back();
      w.id = in_.ConsumeIntegral<uint64_t>();
      w.hostname = in_.ConsumeRandomLengthString(16);
      w.gpu = in_.ConsumeRandomLengthString(8);
      w.waits = in_.ConsumeRandomLengthString(32);
      w.host_used = in_.ConsumeIntegral<int64_t>();
      w.host_capacity = in_.ConsumeIntegral<int64_t>();
      w.blocked_on.push_back(in_.ConsumeIntegral<uint64_t>());
      w.has_last_run = in_.ConsumeBool();
      w.last_run.role_peaks.emplace_back(in_.ConsumeRandomLengthString(8),
                                         in_.ConsumeIntegral<int64_t>());
      w.last_run.wall_ms = in_.ConsumeFloatingPoint<double>();
    }
    return view;
  }

  std::vector<dashboard::JobView> Jobs() override {
    std::vector<dashboard::JobView> jobs;
    const int count = in_.ConsumeIntegralInRange(0, 2);
    for (int i = 0; i < count; ++i) {
      dashboard::JobView& job = jobs.emplace_back();
      job.name = in_.ConsumeRandomLengthString(16);
      job.driver = in_.ConsumeIntegral<uint64_t>();
      dashboard::JobPoint& point = job.points.emplace_back();
      point.step = in_.ConsumeIntegral<int64_t>();
      point.loss = in_.ConsumeFloatingPoint<double>();
      point.step_ms = in_.ConsumeFloatingPoint<double>();
      point.tokens_per_second = in_.ConsumeFloatingPoint<double>();
    }
    return jobs;
  }

  dashboard::TimelineView Timeline() override {
    dashboard::TimelineView view;
    view.now_ms = in_.ConsumeFloatingPoint<double>();
    const int count = in_.ConsumeIntegralInRange(0, 2);
    for (int i = 0; i < count; ++i) {
      dashboard::TimelineSpan& span = view.spans.emplace_back();
      span.name = in_.ConsumeRandomLengthString(16);
      span.stream = in_.ConsumeRandomLengthString(8);
      span.kind = in_.ConsumeRandomLengthString(8);
      span.start_ms = in_.ConsumeFloatingPoint<double>();
      span.end_ms = in_.ConsumeFloatingPoint<double>();
    }
    return view;
  }

 private:
  FuzzedDataProvider& in_;
};

HttpRequest FieldsOf(const std::string& text) {
  std::vector<std::string> fields(4);
  size_t field = 0;
  for (char c : text) {
    if (c == '\n' && field + 1 < fields.size()) {
      ++field;
    } else {
      fields[field] += c;
    }
  }
  return HttpRequest{
      .method = fields[0], .target = fields[1], .cookie = fields[2], .authorization = fields[3]};
}

void Run(const uint8_t* data, size_t size) {
  if (size < 1) return;
  FuzzedDataProvider in(data + 1, size - 1);
  const std::string request_bytes = in.ConsumeRandomLengthString(4096);
  HttpRequest request;
  if (data[0] % 2 == 0) {
    Result<HttpRequest> parsed = dashboard::ParseHttpRequest(request_bytes, 16 * 1024, 4 * 1024);
    if (!parsed.ok()) return;  // the server answers 400 or 413
    request = *std::move(parsed);
  } else {
    request = FieldsOf(request_bytes);
  }
  FuzzedSource source(in);
  const dashboard::HttpHandler handler(kToken, &source);
  try {
    const dashboard::HttpResponse response = handler.Handle(request);
    if (response.status < 100 || response.status > 599) std::abort();
  } catch (const std::exception& e) {
    // An exception out of the handler would end the scheduler's io thread.
    std::fprintf(stderr, "the handler threw: %s\n", e.what());
    std::abort();
  }
}

Seed Request(uint8_t mode, const std::string& text) {
  // ConsumeRandomLengthString reads up to a backslash not followed by another: doubled here.
  Seed seed = {mode};
  for (char c : text) {
    seed.push_back(static_cast<uint8_t>(c));
    if (c == '\\') seed.push_back('\\');
  }
  seed.push_back('\\');
  seed.push_back('n');  // ends the string
  // The snapshot's first strings: a session directory, then a host name with invalid UTF-8 and a
  // quote, a GPU, a worker's waits (each ended by a backslash and another character).
  for (char c : std::string("sess\\nh\xff\xfe\"ost\\ngpu\\nwait\xc3\\n")) {
    seed.push_back(static_cast<uint8_t>(c));
  }
  for (int i = 0; i < 48; ++i) seed.push_back(static_cast<uint8_t>(i * 37));
  return seed;
}

std::vector<Seed> Seeds() {
  const std::string bearer = std::string("Authorization: Bearer ") + kToken + "\r\n";
  std::vector<Seed> seeds;
  for (const char* path : {"/", "/dashboard.js", "/dashboard.css", "/api/cluster", "/api/job",
                           "/api/timeline", "/api/waits", "/metrics", "/nowhere"}) {
    seeds.push_back(
        Request(0, std::string("GET ") + path + " HTTP/1.1\r\nHost: h\r\n" + bearer + "\r\n"));
    seeds.push_back(Request(1, std::string("GET\n") + path + "\n\nBearer " + kToken));
  }
  seeds.push_back(Request(0, std::string("GET /?token=") + kToken + " HTTP/1.1\r\n\r\n"));
  seeds.push_back(Request(0, std::string("HEAD /metrics HTTP/1.1\r\nCookie: a=1; tessera_token=") +
                                 kToken + "\r\n\r\n"));
  seeds.push_back(
      Request(0, "POST /api/job HTTP/1.1\r\n" + bearer + "Content-Length: 4\r\n\r\nabcd"));
  seeds.push_back(Request(0, "GET /api/job HTTP/1.1\r\nAuthorization: Bearer nope\r\n\r\n"));
  seeds.push_back(Request(1, "GET\n/api/cluster?token=%30123456789abcde%66&x=%zz\n\n"));
  seeds.push_back(Request(1, std::string("GET\n/api/waits\ntessera_token=") + kToken + "\n"));
  return seeds;
}

}  // namespace
}  // namespace tessera::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  tessera::fuzz::InitializeTarget(tessera::fuzz::Seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tessera::fuzz::Run(data, size);
  return 0;
}
