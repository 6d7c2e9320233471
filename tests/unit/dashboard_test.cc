// The dashboard's HTTP handling without sockets (the token, routes, JSON shapes, Prometheus
// text checked by a strict parser), then the server over a real socket, with malformed and
// oversized requests and silent clients thrown at it.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

// Boost 1.74's Asio under GCC 12 in C++20 needs <utility> first (included above).
#include <fmt/format.h>
#include <gtest/gtest-spi.h>
#include <boost/asio.hpp>
#include <nlohmann/json.hpp>

#include "core/version.h"
#include "dashboard/api_json.h"
#include "dashboard/http_handler.h"
#include "dashboard/http_parse.h"
#include "dashboard/http_server.h"
#include "dashboard/prometheus.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using dashboard::HttpHandler;
using dashboard::HttpRequest;
using dashboard::HttpResponse;
using nlohmann::json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

constexpr const char* kToken = "0123456789abcdef";

class FakeSource : public dashboard::DashboardSource {
 public:
  dashboard::ClusterView Cluster() override {
    dashboard::ClusterView view;
    view.session_dir = "/tmp/session";
    view.uptime_s = 12.5;
    view.drivers = 1;
    view.objects = 42;
    view.tasks_queued = 3;
    view.tasks_running = 2;
    view.tasks_done = 100;
    for (uint64_t id : {2, 3}) {
      dashboard::WorkerView& w = view.workers.emplace_back();
      w.id = id;
      w.hostname =
          "host \"quoted\"\nline" + odd;  // label-hostile text stays out of /metrics labels
      w.pid = 1000 + static_cast<int>(id);
      w.alive = id == 2;
      w.host_used = 1 << 20;
      w.host_capacity = 1 << 30;
      w.spilled = 4096;
      w.tasks_in_flight = 1;
      w.tasks_done = 50;
      w.bytes_pulled = 10;
      w.bytes_served = 20;
      w.bytes_pushed = 30;
      if (id == 2) {
        w.gpu = "NVIDIA H200 (cuda:0)";
        w.cpus = "0-3";
        w.gpu_use = GpuUse{0.25, int64_t{3} << 30, int64_t{140} << 30};
      }
      w.collective_bytes_sent = 40;
      w.cpu_seconds = 7.5;
      w.cpu_utilization = 0.5;
      w.objects = 9;
      w.restores = 2;
      w.device_bytes = id == 2 ? 8192 : 0;
      w.spilled_total = 16384;
      w.has_last_run = id == 2;
      w.last_run.model_state_peak = 123456;
      w.last_run.role_peaks = {{"parameter", 1000}, {"gradient", 2000}};
      w.last_run.wall_ms = 20.5;
      if (id == 2) {
        w.waits =
            "waits in collective 7/all_reduce (rank 0 of 2) for worker3, which has not "
            "answered for 1.5 s" +
            odd;
        w.blocked_on = {3};
      }
    }
    return view;
  }
  std::vector<dashboard::JobView> Jobs() override {
    dashboard::JobView job;
    job.name = "train \"gpt2\"" + odd;
    job.driver = 4;
    job.plan = "data_parallel=2 zero_stage=2" + odd;
    job.connected = true;
    for (int64_t step = 1; step <= steps; ++step) {
      job.points.push_back({.step = step,
                            .time_s = static_cast<double>(step),
                            .loss = 5.0 / static_cast<double>(step),
                            .step_ms = 20,
                            .tokens_per_second = 25000,
                            .validation_loss = step == 2 ? 4.5 : kNaN});
      job.step_times.Add(0.02);
    }
    job.steps_reported = steps;
    return {job};
  }
  dashboard::TimelineView Timeline() override {
    dashboard::TimelineView view{.now_ms = 1000};
    view.spans.push_back({.worker = 2,
                          .stream = "compute 0",
                          .name = "block0/attention_forward" + odd,
                          .kind = "forward",
                          .start_ms = 10,
                          .end_ms = 30,
                          .graph_id = 1,
                          .instance = 5});
    return view;
  }
  std::string SessionDir() override { return session_dir; }
  int64_t steps = 3;
  std::string odd;          // appended to every text that comes off the wire (names, waits)
  std::string session_dir;  // the logs' (empty: none)
};

class DashboardHandlerTest : public ::testing::Test {
 protected:
  HttpResponse Get(const std::string& target, const std::string& authorization = "",
                   const std::string& cookie = "", const std::string& method = "GET") {
    return handler_.Handle(HttpRequest{
        .method = method, .target = target, .cookie = cookie, .authorization = authorization});
  }
  static std::string Bearer() { return std::string("Bearer ") + kToken; }

  FakeSource source_;
  HttpHandler handler_{kToken, &source_};
};

std::string Header(const HttpResponse& response, const std::string& name) {
  for (const auto& [key, value] : response.headers) {
    if (key == name) return value;
  }
  return "";
}

TEST_F(DashboardHandlerTest, EveryRouteRefusesARequestWithoutTheToken) {
  for (const char* target : {"/", "/dashboard.js", "/dashboard.css", "/api/cluster", "/api/job",
                             "/api/timeline", "/api/waits", "/api/logs", "/api/logs/scheduler",
                             "/metrics", "/no-such-page", "/?token=wrong"}) {
    for (const auto& [authorization, cookie] : std::vector<std::pair<std::string, std::string>>{
             {"", ""},
             {"Bearer wrong", ""},
             {"Bearer ", ""},
             {std::string("Basic ") + kToken, ""},
             {"", "tessera_token=wrong"},
             {"", std::string("other=") + kToken},
             {std::string("Bearer ") + kToken + "x", ""}}) {
      const HttpResponse response = Get(target, authorization, cookie);
      EXPECT_EQ(response.status, 401) << target << " " << authorization << " " << cookie;
      // Nothing about the cluster, and the same answer whether the route exists or not.
      EXPECT_EQ(response.body, "unauthorized: this dashboard needs the cluster token\n");
      EXPECT_TRUE(Header(response, "Set-Cookie").empty());
    }
  }
  EXPECT_EQ(Get("/api/cluster", "", "", "POST").status, 401);
}

TEST_F(DashboardHandlerTest, TheTokenWorksAsBearerCookieOrOnceInTheQuery) {
  EXPECT_EQ(Get("/api/cluster", Bearer()).status, 200);
  EXPECT_EQ(Get("/api/cluster", "", std::string("a=b; tessera_token=") + kToken).status, 200);
  EXPECT_EQ(Get(std::string("/api/cluster?token=") + kToken).status, 200);
  // The page opened with ?token= is redirected without it, the token kept in a cookie.
  const HttpResponse opened = Get(std::string("/?token=") + kToken);
  EXPECT_EQ(opened.status, 303);
  EXPECT_EQ(Header(opened, "Location"), "/");
  const std::string cookie = Header(opened, "Set-Cookie");
  EXPECT_EQ(cookie.rfind(std::string("tessera_token=") + kToken + ";", 0), 0u) << cookie;
  EXPECT_NE(cookie.find("HttpOnly"), std::string::npos);
  EXPECT_NE(cookie.find("SameSite=Strict"), std::string::npos);
  const HttpResponse page = Get("/", "", cookie.substr(0, cookie.find(';')));
  EXPECT_EQ(page.status, 200);
  EXPECT_EQ(page.content_type, "text/html; charset=utf-8");
  EXPECT_NE(page.body.find("<canvas id=\"plot-loss\""), std::string::npos);
  EXPECT_NE(page.body.find("/dashboard.js"), std::string::npos);
  // No external resources: everything is served by the scheduler.
  EXPECT_EQ(page.body.find("http"), std::string::npos);
  EXPECT_NE(Get("/dashboard.js", Bearer()).body.find("/api/timeline"), std::string::npos);
  EXPECT_EQ(Get("/dashboard.css", Bearer()).content_type, "text/css; charset=utf-8");
}

TEST_F(DashboardHandlerTest, UnknownPathsAre404AndOtherMethods405) {
  EXPECT_EQ(Get("/api/nope", Bearer()).status, 404);
  EXPECT_EQ(Get("/../etc/passwd", Bearer()).status, 404);
  EXPECT_EQ(Get("", Bearer()).status, 404);
  const HttpResponse post = Get("/api/cluster", Bearer(), "", "POST");
  EXPECT_EQ(post.status, 405);
  EXPECT_EQ(Header(post, "Allow"), "GET, HEAD");
  EXPECT_EQ(Get("/metrics", Bearer(), "", "HEAD").status, 200);
}

TEST_F(DashboardHandlerTest, ClusterJobAndTimelineJsonHaveTheDocumentedShape) {
  const HttpResponse cluster_response = Get("/api/cluster", Bearer());
  EXPECT_EQ(cluster_response.content_type, "application/json");
  const json cluster = json::parse(cluster_response.body);
  EXPECT_EQ(cluster["session_dir"], "/tmp/session");
  EXPECT_EQ(cluster["tasks"]["queued"], 3);
  EXPECT_EQ(cluster["tasks"]["running"], 2);
  EXPECT_EQ(cluster["tasks"]["done"], 100);
  ASSERT_EQ(cluster["workers"].size(), 2u);
  const json& w = cluster["workers"][0];
  EXPECT_EQ(w["id"], 2);
  EXPECT_EQ(w["alive"], true);
  EXPECT_EQ(w["memory"]["host_used"], 1 << 20);
  EXPECT_EQ(w["memory"]["host_capacity"], 1 << 30);
  EXPECT_EQ(w["memory"]["spilled"], 4096);
  EXPECT_EQ(w["tasks"]["in_flight"], 1);
  EXPECT_EQ(w["bytes"]["pushed"], 30);
  EXPECT_EQ(w["gpu"], "NVIDIA H200 (cuda:0)");
  EXPECT_EQ(cluster["workers"][1]["gpu"], "");  // a CPU worker
  EXPECT_EQ(w["cpus"], "0-3");
  EXPECT_EQ(cluster["workers"][1]["cpus"], "");  // not said
  EXPECT_EQ(w["last_run"]["model_state_peak"], 123456);
  EXPECT_EQ(w["last_run"]["role_peaks"]["gradient"], 2000);
  EXPECT_TRUE(cluster["workers"][1]["last_run"].is_null());
  EXPECT_DOUBLE_EQ(w["cpu"]["seconds"].get<double>(), 7.5);
  EXPECT_DOUBLE_EQ(w["cpu"]["utilization"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(w["gpu_use"]["utilization"].get<double>(), 0.25);
  EXPECT_EQ(w["gpu_use"]["memory_used"], int64_t{3} << 30);
  EXPECT_EQ(w["gpu_use"]["memory_total"], int64_t{140} << 30);
  EXPECT_TRUE(cluster["workers"][1]["gpu_use"].is_null());  // a CPU worker reports none
  EXPECT_EQ(w["store"]["objects"], 9);
  EXPECT_EQ(w["store"]["restores"], 2);
  EXPECT_EQ(w["memory"]["device"], 8192);
  EXPECT_EQ(w["memory"]["spilled_total"], 16384);

  const json jobs = json::parse(Get("/api/job", Bearer()).body);
  ASSERT_EQ(jobs["jobs"].size(), 1u);
  const json& points = jobs["jobs"][0]["points"];
  ASSERT_EQ(points.size(), 3u);
  EXPECT_EQ(points[2]["step"], 3);
  EXPECT_DOUBLE_EQ(points[0]["loss"].get<double>(), 5.0);
  EXPECT_TRUE(points[0]["samples_per_second"].is_null());  // NaN: not reported
  EXPECT_TRUE(points[0]["validation_loss"].is_null());     // not evaluated
  EXPECT_DOUBLE_EQ(points[1]["validation_loss"].get<double>(), 4.5);
  EXPECT_EQ(jobs["jobs"][0]["plan"], "data_parallel=2 zero_stage=2");
  EXPECT_EQ(jobs["jobs"][0]["steps_reported"], 3);

  const json waits = json::parse(Get("/api/waits", Bearer()).body);
  ASSERT_EQ(waits["workers"].size(), 2u);
  EXPECT_EQ(waits["workers"][0]["id"], 2);
  EXPECT_NE(waits["workers"][0]["waits"].get<std::string>().find("worker3"), std::string::npos);
  EXPECT_EQ(waits["workers"][0]["blocked_on"], json::array({3}));
  EXPECT_EQ(waits["workers"][1]["blocked_on"], json::array());
  EXPECT_NE(Get("/dashboard.js", Bearer()).body.find("/api/waits"), std::string::npos);

  const json timeline = json::parse(Get("/api/timeline", Bearer()).body);
  ASSERT_EQ(timeline["spans"].size(), 1u);
  EXPECT_EQ(timeline["spans"][0]["worker"], 2);
  EXPECT_EQ(timeline["spans"][0]["kind"], "forward");
  EXPECT_EQ(timeline["spans"][0]["stream"], "compute 0");
  EXPECT_DOUBLE_EQ(timeline["spans"][0]["end_ms"].get<double>(), 30.0);
}

// The logs view's routes: the session's logs by name, the end of one, and refusals that name
// what is wrong (core/session_logs.h decides what a log is).
TEST_F(DashboardHandlerTest, LogsAreListedAndReadByName) {
  const HttpResponse none = Get("/api/logs", Bearer());
  EXPECT_EQ(none.status, 200);
  EXPECT_EQ(nlohmann::json::parse(none.body)["logs"].size(), 0u);
  EXPECT_EQ(Get("/api/logs/scheduler", Bearer()).status, 404);

  const std::string dir = testing::TempPath("dashboard_logs");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream scheduler(dir + "/scheduler.log");
    for (int line = 1; line <= 300; ++line) scheduler << "line " << line << "\n";
  }
  std::ofstream(dir + "/worker-0.log") << "worker2 joined\n";
  std::filesystem::create_symlink("worker-0.log", dir + "/worker2.log");
  source_.session_dir = dir;
  const HttpResponse listed = Get("/api/logs", Bearer());
  ASSERT_EQ(listed.status, 200);
  EXPECT_EQ(listed.content_type, "application/json");
  const nlohmann::json logs = nlohmann::json::parse(listed.body);
  EXPECT_EQ(logs["session_dir"], dir);
  ASSERT_EQ(logs["logs"].size(), 2u);
  EXPECT_EQ(logs["logs"][0]["name"], "scheduler");
  EXPECT_EQ(logs["logs"][1]["name"], "worker2");
  EXPECT_EQ(logs["logs"][1]["bytes"], 15);
  EXPECT_GT(logs["logs"][1]["modified_unix_s"].get<int64_t>(), 1'600'000'000);

  const HttpResponse worker = Get("/api/logs/worker2", Bearer());
  EXPECT_EQ(worker.status, 200);
  EXPECT_EQ(worker.content_type, "text/plain; charset=utf-8");
  EXPECT_EQ(worker.body, "worker2 joined\n");
  const HttpResponse tail = Get("/api/logs/scheduler", Bearer());  // the last 200 lines
  EXPECT_EQ(tail.body.substr(0, 9), "line 101\n");
  EXPECT_EQ(Get("/api/logs/scheduler?lines=2", Bearer()).body, "line 299\nline 300\n");
  EXPECT_EQ(Get("/api/logs/scheduler?lines=0", Bearer()).body.substr(0, 7), "line 1\n");
  EXPECT_EQ(Get("/api/logs/scheduler?lines=-1", Bearer()).status, 400);
  EXPECT_EQ(Get("/api/logs/scheduler?lines=x", Bearer()).status, 400);
  const HttpResponse unknown = Get("/api/logs/worker9", Bearer());
  EXPECT_EQ(unknown.status, 404);
  EXPECT_NE(unknown.body.find("no log named 'worker9'"), std::string::npos) << unknown.body;
  // Nothing outside the session: a name with a slash, however it is written, is refused.
  EXPECT_EQ(Get("/api/logs/..%2Ftoken", Bearer()).status, 400);
  EXPECT_EQ(Get("/api/logs/token", Bearer()).status, 404);  // the token file is no log
  std::filesystem::remove_all(dir);
}

TEST_F(DashboardHandlerTest, TextFromTheWireThatIsNotUtf8IsReplacedOnEveryRoute) {
  // Host names, waits, job and span names reach the scheduler as bytes (Cap'n Proto does not
  // check UTF-8): no route may throw on them (an exception would end the scheduler's io thread).
  // Found by fuzz_http_handler.
  source_.odd = "\xff\xfe\xc3";
  for (const char* path : {"/api/cluster", "/api/job", "/api/timeline", "/api/waits"}) {
    HttpResponse response;
    ASSERT_NO_THROW(response = Get(path, Bearer())) << path;
    EXPECT_EQ(response.status, 200) << path;
    EXPECT_TRUE(json::accept(response.body)) << path;
  }
  const json waits = json::parse(Get("/api/waits", Bearer()).body);
  EXPECT_NE(waits["workers"][0]["hostname"].get<std::string>().find("\xef\xbf\xbd"),
            std::string::npos)
      << "replaced by U+FFFD";
  EXPECT_EQ(Get("/metrics", Bearer()).status, 200);
}

TEST(DashboardParseTest, RequestsAreReadAsTheServerReadsThem) {
  ASSERT_OK_AND_ASSIGN(
      HttpRequest request,
      dashboard::ParseHttpRequest("GET /api/job?x=1 HTTP/1.1\r\nHost: h\r\nCookie: a=b\r\n"
                                  "Authorization: Bearer t\r\n\r\n",
                                  1024, 64));
  EXPECT_EQ(request.method, "GET");
  EXPECT_EQ(request.target, "/api/job?x=1");
  EXPECT_EQ(request.cookie, "a=b");
  EXPECT_EQ(request.authorization, "Bearer t");
  const std::string big_header = "GET / HTTP/1.1\r\nX: " + std::string(2048, 'x') + "\r\n\r\n";
  EXPECT_EQ(dashboard::ParseHttpRequest(big_header, 1024, 64).status().code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(dashboard::ParseHttpRequest(
                "POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + std::string(100, 'b'), 1024, 64)
                .status()
                .code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(dashboard::ParseHttpRequest("\x01\x02 nonsense\r\n\r\n", 1024, 64).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(dashboard::ParseHttpRequest("GET / HTTP/1.1\r\nHost:", 1024, 64).status().code(),
            StatusCode::kInvalidArgument)
      << "it ends before the request does";
}

TEST(DashboardQueryTest, QueryValuesAndCookiesAreParsed) {
  EXPECT_EQ(dashboard::QueryValue("/a?token=x%2Fy&b=2", "token"), "x/y");
  EXPECT_EQ(dashboard::QueryValue("/a?b=2&token=z", "token"), "z");
  EXPECT_EQ(dashboard::QueryValue("/a?tokens=1", "token"), "");
  EXPECT_EQ(dashboard::QueryValue("/a", "token"), "");
  EXPECT_EQ(dashboard::QueryValue("/a?token=%zz%", "token"), "%zz%");
  EXPECT_EQ(dashboard::CookieValue("a=1; tessera_token=abc; b=2", "tessera_token"), "abc");
  EXPECT_EQ(dashboard::CookieValue("xtessera_token=abc", "tessera_token"), "");
}

// ---- /metrics: a strict parser of the Prometheus text format 0.0.4 ----

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses `text`, failing the test (with the line) on anything the format does not allow or
// this exporter promises not to do: a sample before its family's TYPE, a family split or typed
// twice, a bad name, label or value, a duplicate series.
std::vector<Sample> ParsePrometheus(const std::string& text) {
  static const std::regex kName("[a-zA-Z_:][a-zA-Z0-9_:]*");
  static const std::regex kLabelName("[a-zA-Z_][a-zA-Z0-9_]*");
  static const std::set<std::string> kTypes = {"counter", "gauge", "histogram", "summary",
                                               "untyped"};
  std::vector<Sample> samples;
  std::map<std::string, std::string> types;
  std::set<std::string> helped, closed_families, series;
  std::string current_family;
  EXPECT_TRUE(!text.empty() && text.back() == '\n') << "the text must end with a newline";
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    SCOPED_TRACE(line);
    EXPECT_FALSE(line.empty()) << "no blank lines";
    if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) {
      const std::string rest = line.substr(7);
      const size_t space = rest.find(' ');
      EXPECT_NE(space, std::string::npos);
      const std::string name = rest.substr(0, space);
      const std::string value = rest.substr(space + 1);
      EXPECT_TRUE(std::regex_match(name, kName));
      EXPECT_TRUE(name.starts_with("tessera_"));
      EXPECT_EQ(closed_families.count(name), 0u) << "family " << name << " appears twice";
      if (current_family != name && !current_family.empty()) {
        closed_families.insert(current_family);
      }
      current_family = name;
      if (line[2] == 'H') {
        EXPECT_TRUE(helped.insert(name).second) << "HELP twice";
        EXPECT_EQ(types.count(name), 0u) << "HELP after TYPE";
        EXPECT_FALSE(value.empty());
      } else {
        EXPECT_TRUE(types.emplace(name, value).second) << "TYPE twice";
        EXPECT_EQ(kTypes.count(value), 1u) << "unknown type " << value;
      }
      continue;
    }
    EXPECT_NE(line[0], '#') << "only HELP and TYPE comments are written";
    // name{label="value",...} value
    Sample sample;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    sample.name = line.substr(0, i);
    EXPECT_TRUE(std::regex_match(sample.name, kName)) << sample.name;
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const size_t eq = line.find('=', i);
        if (eq == std::string::npos) {
          ADD_FAILURE() << "label without '='";
          return samples;
        }
        const std::string label = line.substr(i, eq - i);
        EXPECT_TRUE(std::regex_match(label, kLabelName)) << label;
        EXPECT_FALSE(label.starts_with("__")) << "reserved label name";
        i = eq + 1;
        if (i >= line.size() || line[i] != '"') {
          ADD_FAILURE() << "label value not quoted";
          return samples;
        }
        ++i;
        std::string value;
        while (i < line.size() && line[i] != '"') {
          if (line[i] == '\\') {
            ++i;
            EXPECT_TRUE(i < line.size() && (line[i] == '\\' || line[i] == '"' || line[i] == 'n'))
                << "bad escape";
            value += line[i] == 'n' ? '\n' : line[i];
          } else {
            value += line[i];
          }
          ++i;
        }
        if (i >= line.size()) {
          ADD_FAILURE() << "unterminated label value";
          return samples;
        }
        ++i;  // closing quote
        EXPECT_TRUE(sample.labels.emplace(label, value).second) << "label twice";
        if (i < line.size() && line[i] == ',') ++i;
      }
      EXPECT_LT(i, line.size()) << "unterminated label set";
      ++i;  // '}'
    }
    EXPECT_TRUE(i < line.size() && line[i] == ' ') << "a space before the value";
    const std::string value = line.substr(i + 1);
    EXPECT_EQ(value.find(' '), std::string::npos) << "no timestamps are written";
    if (value == "NaN" || value == "+Inf" || value == "-Inf") {
      sample.value = value == "NaN" ? NAN : (value[0] == '+' ? INFINITY : -INFINITY);
    } else {
      size_t used = 0;
      try {
        sample.value = std::stod(value, &used);
      } catch (...) {
        used = 0;
      }
      EXPECT_TRUE(!value.empty() && used == value.size()) << "value '" << value << "'";
    }
    // The sample belongs to the family declared just before (counters: name_total is the family;
    // a histogram's samples are its _bucket{le}, _sum and _count).
    const bool histogram = types.contains(current_family) && types[current_family] == "histogram";
    if (histogram) {
      const bool bucket = sample.name == current_family + "_bucket";
      EXPECT_TRUE(bucket || sample.name == current_family + "_sum" ||
                  sample.name == current_family + "_count")
          << "sample outside its histogram";
      EXPECT_EQ(bucket, sample.labels.contains("le")) << "le on the buckets, and only there";
    } else {
      EXPECT_EQ(sample.name, current_family) << "sample outside its family";
      EXPECT_EQ(types.count(sample.name), 1u) << "sample before its TYPE";
    }
    std::string key = sample.name;
    for (const auto& [k, v] : sample.labels) key.append("|").append(k).append("=").append(v);
    EXPECT_TRUE(series.insert(key).second) << "duplicate series";
    if (!histogram && types[sample.name] == "counter") {
      EXPECT_TRUE(sample.name.ends_with("_total"));
      EXPECT_GE(sample.value, 0);
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

double ValueOf(const std::vector<Sample>& samples, const std::string& name,
               const std::map<std::string, std::string>& labels = {}) {
  for (const Sample& s : samples) {
    if (s.name == name && s.labels == labels) return s.value;
  }
  ADD_FAILURE() << "no sample " << name;
  return NAN;
}

TEST_F(DashboardHandlerTest, MetricsParseAsPrometheusText) {
  const HttpResponse response = Get("/metrics", Bearer());
  EXPECT_EQ(response.status, 200);
  EXPECT_EQ(response.content_type, "text/plain; version=0.0.4; charset=utf-8");
  const std::vector<Sample> samples = ParsePrometheus(response.body);
  EXPECT_EQ(ValueOf(samples, "tessera_tasks_queued"), 3);
  EXPECT_EQ(ValueOf(samples, "tessera_tasks_running"), 2);
  EXPECT_EQ(ValueOf(samples, "tessera_tasks_done_total"), 100);
  EXPECT_EQ(ValueOf(samples, "tessera_workers_alive"), 1);
  EXPECT_EQ(ValueOf(samples, "tessera_memory_used_bytes", {{"worker", "2"}, {"tier", "host"}}),
            1 << 20);
  EXPECT_EQ(ValueOf(samples, "tessera_memory_capacity_bytes", {{"worker", "3"}, {"tier", "host"}}),
            1 << 30);
  EXPECT_EQ(ValueOf(samples, "tessera_memory_used_bytes", {{"worker", "2"}, {"tier", "device"}}),
            8192);
  EXPECT_EQ(ValueOf(samples, "tessera_memory_spilled_bytes", {{"worker", "2"}}), 4096);
  EXPECT_EQ(ValueOf(samples, "tessera_worker_cpu_seconds_total", {{"worker", "3"}}), 7.5);
  EXPECT_EQ(ValueOf(samples, "tessera_worker_objects", {{"worker", "2"}}), 9);
  EXPECT_DOUBLE_EQ(ValueOf(samples, "tessera_worker_gpu_utilization_ratio", {{"worker", "2"}}),
                   0.25);
  EXPECT_EQ(ValueOf(samples, "tessera_worker_gpu_memory_used_bytes", {{"worker", "2"}}),
            double(int64_t{3} << 30));
  EXPECT_EQ(ValueOf(samples, "tessera_worker_gpu_memory_total_bytes", {{"worker", "2"}}),
            double(int64_t{140} << 30));
  EXPECT_EQ(ValueOf(samples, "tessera_worker_restores_total", {{"worker", "2"}}), 2);
  EXPECT_EQ(ValueOf(samples, "tessera_bytes_pulled_total", {{"worker", "2"}}), 10);
  EXPECT_EQ(ValueOf(samples, "tessera_bytes_served_total", {{"worker", "2"}}), 20);
  EXPECT_EQ(ValueOf(samples, "tessera_bytes_pushed_total", {{"worker", "3"}}), 30);
  EXPECT_EQ(ValueOf(samples, "tessera_model_state_peak_bytes", {{"worker", "2"}}), 123456);
  const std::map<std::string, std::string> job = {{"job", "train \"gpt2\""}, {"driver", "4"}};
  EXPECT_EQ(ValueOf(samples, "tessera_job_step", job), 3);
  EXPECT_DOUBLE_EQ(ValueOf(samples, "tessera_job_loss", job), 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(ValueOf(samples, "tessera_job_step_seconds", job), 0.02);
  // Over every step: a counter and a histogram of step times (three steps of 20 ms).
  EXPECT_EQ(ValueOf(samples, "tessera_job_steps_total", job), 3);
  auto bucket = [&](const std::string& le) {
    std::map<std::string, std::string> labels = job;
    labels["le"] = le;
    return ValueOf(samples, "tessera_job_step_duration_seconds_bucket", labels);
  };
  EXPECT_EQ(bucket("0.01"), 0);
  EXPECT_EQ(bucket("0.025"), 3);
  EXPECT_EQ(bucket("60"), 3);
  EXPECT_EQ(bucket("+Inf"), 3);
  EXPECT_EQ(ValueOf(samples, "tessera_job_step_duration_seconds_count", job), 3);
  EXPECT_DOUBLE_EQ(ValueOf(samples, "tessera_job_step_duration_seconds_sum", job), 0.06);
  EXPECT_EQ(ValueOf(samples, "tessera_build_info",
                    {{"version", TesseraVersion()}, {"build", BuildDescription()}}),
            1);
  for (const Sample& s : samples) {
    EXPECT_NE(s.name, "tessera_job_samples_per_second") << "a figure not reported is left out";
    if (s.name.starts_with("tessera_worker_gpu_")) {
      EXPECT_EQ(s.labels.at("worker"), "2") << "a CPU worker has no GPU figures";
    }
    if (s.name == "tessera_model_state_peak_bytes") {
      EXPECT_EQ(s.labels.at("worker"), "2");
    }
  }
}

TEST(DashboardPrometheusTest, TheParserRejectsWhatTheFormatForbids) {
  // The checker itself: each of these must fail.
  for (const char* bad : {
           "tessera_x 1\n",                                       // no TYPE
           "# TYPE tessera_x gauge\ntessera_x{a=1} 1\n",          // unquoted label
           "# TYPE tessera_x gauge\ntessera_x one\n",             // not a number
           "# TYPE tessera_x gauge\ntessera_y 1\n",               // outside its family
           "# TYPE tessera_x gauge\n# TYPE tessera_x gauge\n",    // typed twice
           "# TYPE tessera_x gauge\ntessera_x{a=\"\\t\"} 1\n",    // bad escape
           "# TYPE tessera_x gauge\ntessera_x 1\ntessera_x 2\n",  // duplicate series
           "# TYPE tessera_x counter\ntessera_x 1\n",             // counter without _total
       }) {
    ::testing::TestPartResultArray failures;
    {
      ::testing::ScopedFakeTestPartResultReporter reporter(
          ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
      ParsePrometheus(bad);
    }
    EXPECT_GT(failures.size(), 0) << "accepted: " << bad;
  }
  EXPECT_EQ(dashboard::EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

// ---- over a real socket ----

class DashboardServerTest : public ::testing::Test {
 protected:
  virtual dashboard::HttpServerOptions Options() {
    return {.host = "127.0.0.1", .port = 0, .header_limit_bytes = 2048, .idle_timeout_ms = 500};
  }

  void SetUp() override {
    auto server = dashboard::HttpServer::Start(
        io_, Options(), [this](const HttpRequest& request) { return handler_.Handle(request); });
    ASSERT_OK(server.status());
    server_ = std::move(*server);
    thread_ = std::thread([this] { io_.run(); });
  }
  void TearDown() override {
    boost::asio::post(io_, [this] { server_->Close(); });
    work_.reset();
    thread_.join();
  }

  // Sends `bytes` on a fresh connection and returns everything the server answers until it
  // closes (or 2 s pass).
  std::string Exchange(const std::string& bytes, bool half_close = true) {
    boost::asio::io_context io;
    boost::asio::ip::tcp::socket socket(io);
    socket.connect({boost::asio::ip::make_address("127.0.0.1"), server_->port()});
    // The server may close before it read everything (a refused request): errors are fine.
    boost::system::error_code error;
    boost::asio::write(socket, boost::asio::buffer(bytes), error);
    if (half_close) socket.shutdown(boost::asio::ip::tcp::socket::shutdown_send, error);
    std::string answer;
    char buffer[4096];
    while (true) {
      const size_t n = socket.read_some(boost::asio::buffer(buffer), error);
      if (error) break;
      answer.append(buffer, n);
    }
    return answer;
  }

  std::string GoodRequest(const std::string& path, bool with_token) {
    return "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" +
           (with_token ? std::string("Authorization: Bearer ") + kToken + "\r\n" : "") + "\r\n";
  }

  FakeSource source_;
  HttpHandler handler_{kToken, &source_};
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_ =
      boost::asio::make_work_guard(io_);
  std::unique_ptr<dashboard::HttpServer> server_;
  std::thread thread_;
};

TEST_F(DashboardServerTest, ServesWithTheTokenAndRefusesWithout) {
  const std::string ok = Exchange(GoodRequest("/api/cluster", true));
  EXPECT_TRUE(ok.starts_with("HTTP/1.1 200")) << ok.substr(0, 200);
  EXPECT_NE(ok.find("Cache-Control: no-store"), std::string::npos);
  EXPECT_NE(ok.find("\"session_dir\":\"/tmp/session\""), std::string::npos);
  const std::string refused = Exchange(GoodRequest("/api/cluster", false));
  EXPECT_TRUE(refused.starts_with("HTTP/1.1 401")) << refused.substr(0, 200);
  EXPECT_EQ(refused.find("session"), std::string::npos);
  // Two requests on one kept-alive connection.
  const std::string two =
      Exchange(std::string("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ") + kToken +
               "\r\n\r\n" + GoodRequest("/api/job", true));
  EXPECT_EQ(two.find("HTTP/1.1 200"), 0u);
  EXPECT_NE(two.find("HTTP/1.1 200", 10), std::string::npos) << two.substr(0, 300);
  // HEAD: the length, no body.
  const std::string head =
      Exchange(std::string("HEAD /metrics HTTP/1.1\r\nHost: x\r\n") +
               "Connection: close\r\nAuthorization: Bearer " + kToken + "\r\n\r\n");
  EXPECT_TRUE(head.starts_with("HTTP/1.1 200"));
  EXPECT_TRUE(head.ends_with("\r\n\r\n")) << head;
}

// A host name is as good as an address: "localhost" listens on the loopback address (IPv4
// first), and a name nothing resolves is refused naming it.
class DashboardOnLocalhostTest : public DashboardServerTest {
 protected:
  dashboard::HttpServerOptions Options() override {
    dashboard::HttpServerOptions options = DashboardServerTest::Options();
    options.host = "localhost";
    return options;
  }
};

TEST_F(DashboardOnLocalhostTest, AHostNameIsResolved) {
  const std::string ok = Exchange(GoodRequest("/api/cluster", true));
  EXPECT_TRUE(ok.starts_with("HTTP/1.1 200")) << ok.substr(0, 200);
  EXPECT_EQ(server_->address(), fmt::format("localhost:{}", server_->port()));
  boost::asio::io_context io;
  dashboard::HttpServerOptions nowhere = Options();
  nowhere.host = "no-such-host.invalid";
  Result<std::unique_ptr<dashboard::HttpServer>> refused =
      dashboard::HttpServer::Start(io, nowhere, [](const HttpRequest&) { return HttpResponse{}; });
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("'no-such-host.invalid'"), std::string::npos)
      << refused.status().ToString();
}

TEST_F(DashboardServerTest, MalformedAndOversizedRequestsAreRefusedAndTheServerLivesOn) {
  const std::vector<std::string> bad = {
      "garbage\r\n\r\n",
      "GET\r\n\r\n",
      "GET / HTTP/9.9\r\n\r\n",
      "GET / HTTP/1.1\r\nHost x\r\n\r\n",  // header without ':'
      "GET / HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
      "GET / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
      "GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
      "GET /" + std::string(4096, 'a') + " HTTP/1.1\r\n\r\n",  // header limit
      "GET / HTTP/1.1\r\nX: " + std::string(5000, 'b') + "\r\n\r\n",
      "POST / HTTP/1.1\r\nContent-Length: 100000\r\n\r\n" + std::string(100, 'c'),  // body limit
      std::string("\0\1\2\3\xff\xfe", 6),
      std::string(10000, '\n'),
  };
  for (const std::string& request : bad) {
    const std::string answer = Exchange(request);
    SCOPED_TRACE(request.substr(0, 60));
    // Either a 4xx and a close, or just a close: never a 200, never a hang.
    EXPECT_TRUE(answer.empty() || (answer.starts_with("HTTP/") && answer.substr(8, 2) == " 4"))
        << answer.substr(0, 200);
    EXPECT_EQ(answer.find("session"), std::string::npos);
  }
  // A client that sends half a request and goes silent is closed after the idle timeout.
  const std::string silent = Exchange("GET /api/cluster HTTP/1.1\r\nHost:", /*half_close=*/false);
  EXPECT_EQ(silent.find("200"), std::string::npos);
  // Still serving.
  const std::string ok = Exchange(GoodRequest("/api/timeline", true));
  EXPECT_TRUE(ok.starts_with("HTTP/1.1 200")) << ok.substr(0, 200);
}

// Slow clients cannot lock others out: as many silent connections as the server takes, and an
// idle timeout far longer than the test, so only the eviction of the connection that has waited
// longest for a request can let a request with the token in.
class DashboardSlowClientTest : public DashboardServerTest {
 protected:
  dashboard::HttpServerOptions Options() override {
    return {.host = "127.0.0.1", .port = 0, .max_connections = 64, .idle_timeout_ms = 60'000};
  }
};

TEST_F(DashboardSlowClientTest, SilentConnectionsDoNotLockOutARequestWithTheToken) {
  boost::asio::io_context io;
  const boost::asio::ip::tcp::endpoint server(boost::asio::ip::make_address("127.0.0.1"),
                                              server_->port());
  std::vector<boost::asio::ip::tcp::socket> silent;
  for (int i = 0; i < 64; ++i) {
    silent.emplace_back(io);
    silent.back().connect(server);
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string ok = Exchange(GoodRequest("/api/cluster", true));
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("a request with the token behind 64 silent connections answered in %.1f ms\n", ms);
  EXPECT_TRUE(ok.starts_with("HTTP/1.1 200")) << ok.substr(0, 200);
  EXPECT_LT(ms, 5000) << "a generous bound: the idle timeout is 60 s, the wait should be ms";
  // The silent connection that waited longest made room: the server closed it.
  int closed = 0;
  for (auto& socket : silent) {
    socket.non_blocking(true);
    char byte;
    boost::system::error_code error;
    socket.read_some(boost::asio::buffer(&byte, 1), error);
    closed += error == boost::asio::error::eof || error == boost::asio::error::connection_reset;
  }
  std::printf("%d of the 64 silent connections were closed to make room\n", closed);
  EXPECT_GE(closed, 1);
}

}  // namespace
}  // namespace tessera::testing
