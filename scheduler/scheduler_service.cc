#include "scheduler/scheduler_service.h"

#include <map>
#include <thread>

#include "core/atomic_file.h"
#include "core/logging.h"
#include "core/rpc/connection.h"
#include "core/rpc/io_loop.h"
#include "core/thread_annotations.h"
#include "dashboard/http_handler.h"
#include "dashboard/http_server.h"
#include "scheduler/dashboard_view.h"

namespace tessera {

namespace {

class SchedulerServiceImpl final : public SchedulerService, private Outbox {
 public:
  explicit SchedulerServiceImpl(SchedulerServiceOptions options)
      : options_(std::move(options)),
        work_(rpc::asio::make_work_guard(io_)),
        core_(options_.core, this, [] { return SchedulerCore::Clock::now(); }),
        pending_(options_.preauth),
        tick_(io_),
        dashboard_source_(&core_, SchedulerCore::Clock::now(),
                          [] { return SchedulerCore::Clock::now(); }),
        dashboard_handler_(options_.core.token.empty() ? "-" : options_.core.token,
                           &dashboard_source_) {}

  ~SchedulerServiceImpl() override {
    Stop();
    if (thread_.joinable()) thread_.join();
  }

  Status Init() {
    auto listener = rpc::Listener::Listen(
        io_, options_.address, [this](rpc::GenericSocket socket, const std::string& peer) {
          OnAccept(std::move(socket), peer);
        });
    if (!listener.ok()) return listener.status();
    listener_ = std::move(*listener);
    if (!options_.unix_socket.empty()) {
      auto local =
          rpc::Listener::Listen(io_, rpc::Address::Unix(options_.unix_socket),
                                [this](rpc::GenericSocket socket, const std::string& peer) {
                                  OnAccept(std::move(socket), peer);
                                });
      if (!local.ok()) return local.status();
      unix_listener_ = std::move(*local);
    }
    if (options_.dashboard_port >= 0) {
      if (options_.core.token.empty()) {
        return InvalidArgument("the dashboard needs the cluster token (none was given)");
      }
      if (options_.dashboard_port > 65535) {
        return InvalidArgument("dashboard port {} is out of range", options_.dashboard_port);
      }
      TESSERA_ASSIGN_OR_RETURN(
          dashboard_, dashboard::HttpServer::Start(
                          io_,
                          {.host = options_.dashboard_host,
                           .port = static_cast<uint16_t>(options_.dashboard_port),
                           .idle_timeout_ms = options_.preauth.deadline_ms,
                           .max_pending_per_address = options_.preauth.max_pending_per_address},
                          [this](const dashboard::HttpRequest& request) {
                            return dashboard_handler_.Handle(request);
                          }));
      if (!options_.dashboard_file.empty()) {
        TESSERA_RETURN_IF_ERROR(
            WriteFileAtomically(options_.dashboard_file, dashboard_->address() + "\n"));
      }
      GetLogger("scheduler")->info("dashboard on http://{}/", dashboard_->address());
    }
    if (!options_.address_file.empty()) {
      TESSERA_RETURN_IF_ERROR(
          WriteFileAtomically(options_.address_file, listener_->address().ToString() + "\n"));
    }
    ScheduleTick();
    thread_ = std::thread(
        [this] { rpc::RunIoLoop(io_, std::chrono::microseconds(options_.idle_spin_us)); });
    GetLogger("scheduler")->info("listening on {}", listener_->address().ToString());
    return Status::Ok();
  }

  const rpc::Address& address() const override { return listener_->address(); }
  std::string dashboard_address() const override {
    return dashboard_ ? dashboard_->address() : std::string();
  }

  void Wait() override {
    MutexLock lock(&mutex_);
    while (!stopped_) stopped_cv_.Wait(&mutex_);
  }

  void Stop() override {
    rpc::asio::post(io_, [this] { Shutdown(); });
  }

 private:
  void OnAccept(rpc::GenericSocket socket, const std::string& peer) {
    const WorkerId id = core_.Accept();
    auto connection =
        rpc::Connection::Create(std::move(socket), peer, options_.preauth_frame_bytes);
    connections_[id] = connection;
    // Pending until its Hello is accepted; room for it may cost the oldest pending connection.
    for (uint64_t evicted : pending_.Add(id.value(), PendingConnections::AddressOf(peer),
                                         SchedulerCore::Clock::now())) {
      ++shed_.over_cap;
      CloseConnection(WorkerId(evicted),
                      ResourceExhausted("too many connections have not said Hello yet (at most "
                                        "{} in all, {} per address): the oldest is closed",
                                        options_.preauth.max_pending,
                                        options_.preauth.max_pending_per_address));
    }
    connection->Start(
        [this, id](rpc::Connection& self, rpc::ReceivedMessage& message) -> Status {
          Status status = core_.Handle(id, message.reader().getRoot<proto::Envelope>());
          if (pending_.contains(id.value()) && core_.Admitted(id)) {
            pending_.Remove(id.value());
            self.Admit();
          }
          ScheduleFlush();
          if (core_.shutdown_requested()) ScheduleShutdown();
          if (!status.ok()) {
            // A protocol violation: drop the peer, but only after what the core queued for it
            // (e.g. the reason it was refused) has gone out.
            GetLogger("scheduler")
                ->warn("closing {} ({}): {}", self.peer(), id.ToString(), status.ToString());
            self.CloseWhenFlushed(status);
          }
          return Status::Ok();
        },
        [this, id](rpc::Connection&, const Status& reason) {
          pending_.Remove(id.value());
          connections_.erase(id);
          core_.Disconnected(id, reason);
          ScheduleFlush();
        });
  }

  void CloseConnection(WorkerId id, const Status& reason) {
    auto it = connections_.find(id);
    if (it != connections_.end()) it->second->Close(reason);
  }

  // Closes the pending connections past their deadline; says how many were shed, at most every
  // kShedLogInterval (a flood must not flood the log too).
  void ShedPending(SchedulerCore::Clock::time_point now) {
    for (uint64_t expired : pending_.TakeExpired(now)) {
      ++shed_.expired;
      CloseConnection(WorkerId(expired), TimedOut("no Hello within {} ms of connecting",
                                                  options_.preauth.deadline_ms));
    }
    if ((shed_.expired > 0 || shed_.over_cap > 0) && now - shed_.logged >= kShedLogInterval) {
      GetLogger("scheduler")
          ->warn(
              "closed {} connection(s) that did not say Hello within {} ms and {} over the "
              "caps on pending connections ({} in all, {} per address); {} pending now",
              shed_.expired, options_.preauth.deadline_ms, shed_.over_cap,
              options_.preauth.max_pending, options_.preauth.max_pending_per_address,
              pending_.size());
      shed_ = ShedCounts{.logged = now};
    }
  }

  // Outbox
  void Send(WorkerId to, capnp::MessageBuilder& message) override {
    auto it = connections_.find(to);
    if (it != connections_.end()) it->second->Send(message);
  }
  void Disconnect(WorkerId who, const Status& reason) override {
    auto it = connections_.find(who);
    if (it != connections_.end()) it->second->CloseWhenFlushed(reason);
  }

  void ScheduleTick() {
    // Often enough for heartbeat checks and collective verdicts (a 250 ms window).
    tick_.expires_after(
        std::chrono::milliseconds(std::min<uint32_t>(options_.core.heartbeat_interval_ms, 100)));
    tick_.async_wait([this](const boost::system::error_code& error) {
      if (error || stopping_) return;
      ShedPending(SchedulerCore::Clock::now());
      core_.Tick();
      core_.Flush();
      ScheduleTick();
    });
  }

  // Runs the core's Flush after every handler already queued on the io thread: all messages read
  // in this turn of the loop share the outgoing batches.
  void ScheduleFlush() {
    if (flush_posted_) return;
    flush_posted_ = true;
    rpc::asio::post(io_, [this] {
      flush_posted_ = false;
      core_.Flush();
    });
  }

  // Gives the shutdown broadcast a moment to reach the workers, then stops.
  void ScheduleShutdown() {
    if (stopping_) return;
    stopping_ = true;
    auto timer = std::make_shared<rpc::asio::steady_timer>(io_, std::chrono::milliseconds(200));
    timer->async_wait([this, timer](const boost::system::error_code&) { Shutdown(); });
  }

  void Shutdown() {
    stopping_ = true;
    tick_.cancel();
    if (listener_) listener_->Close();
    if (unix_listener_) unix_listener_->Close();
    if (dashboard_) dashboard_->Close();
    for (auto& [id, connection] : connections_) connection->Close(Cancelled("scheduler stopping"));
    work_.reset();
    {
      MutexLock lock(&mutex_);
      stopped_ = true;
    }
    stopped_cv_.NotifyAll();
    rpc::asio::post(io_, [this] { io_.stop(); });
  }

  const SchedulerServiceOptions options_;
  rpc::asio::io_context io_;
  rpc::asio::executor_work_guard<rpc::asio::io_context::executor_type> work_;
  SchedulerCore core_;
  // Connections that have not said Hello yet (ids are participant ids).
  PendingConnections pending_;
  struct ShedCounts {
    int64_t expired = 0;
    int64_t over_cap = 0;
    SchedulerCore::Clock::time_point logged{};
  };
  static constexpr std::chrono::seconds kShedLogInterval{10};
  ShedCounts shed_;
  rpc::asio::steady_timer tick_;
  std::unique_ptr<rpc::Listener> listener_;
  std::unique_ptr<rpc::Listener> unix_listener_;
  CoreDashboardSource dashboard_source_;
  dashboard::HttpHandler dashboard_handler_;
  std::unique_ptr<dashboard::HttpServer> dashboard_;
  std::map<WorkerId, std::shared_ptr<rpc::Connection>> connections_;
  std::thread thread_;
  bool stopping_ = false;
  bool flush_posted_ = false;

  Mutex mutex_;
  CondVar stopped_cv_;
  bool stopped_ GUARDED_BY(mutex_) = false;
};

}  // namespace

Result<std::unique_ptr<SchedulerService>> SchedulerService::Start(
    const SchedulerServiceOptions& options) {
  auto service = std::make_unique<SchedulerServiceImpl>(options);
  TESSERA_RETURN_IF_ERROR(service->Init());
  return std::unique_ptr<SchedulerService>(std::move(service));
}

}  // namespace tessera
