// ClusterClient: everything behind a Cluster (client/cluster.h), internal to client/. Its
// sources are cluster_client.cc (the connection to the scheduler: joining, batching and flushing
// requests, the messages it answers with, waiting for objects) and cluster_client_objects.cc
// (objects and graphs: Put, Submit, Get, Wait, RegisterGraph, RunGraph).
#pragma once

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "client/cluster.h"
#include "core/proto/tessera.capnp.h"
#include "core/rpc/connection.h"
#include "core/settings.h"
#include "core/thread_annotations.h"
#include "core/transport/data_plane.h"
#include "ops/op_registry.h"
#include "ops/plugin.h"

namespace tessera {

struct ObjectRef::State {
  ObjectId id;
  TensorMeta meta;
  std::weak_ptr<detail::ClusterClient> owner;
  // Handed to a graph instance with its run (RunGraph's takeOver): the scheduler released this
  // driver's reference then, so the last holder here sends no Release.
  std::atomic<bool> handed_over{false};
  ~State();
};

namespace detail {

constexpr int kIdSequenceBits = 40;  // ids are (driver id << 40) | sequence
constexpr auto kCoalesceWindow = std::chrono::microseconds(100);

// Everything behind a Cluster: the control connection, the data plane, the objects this driver
// holds, and the batches of outgoing requests.
class ClusterClient : public std::enable_shared_from_this<ClusterClient> {
 public:
  ClusterClient() : work_(rpc::asio::make_work_guard(io_)) {}
  ~ClusterClient();

  Status Connect(const std::string& address, const std::string& token,
                 const ConnectOptions& options);
  Result<ObjectRef> Put(const Tensor& value);
  Result<std::vector<ObjectRef>> Submit(const std::string& op, const std::vector<ObjectRef>& inputs,
                                        const Attrs& attrs, const SubmitOptions& options);
  Result<Tensor> Get(const ObjectRef& ref, int timeout_ms);
  Status Wait(const std::vector<ObjectRef>& refs, int timeout_ms);
  Result<ClusterInfo> Info(int timeout_ms);
  Result<Timeline> GetTimeline(int last_instances, uint64_t graph, int timeout_ms);
  Result<GraphHandle> RegisterGraph(const Graph& graph);
  // With `handed_over`, every input `inputs` holds this driver's only reference to is handed
  // to the instance (Cluster::RunGraphHandingOver) and its graph id added there.
  Result<std::map<ObjectId, ObjectRef>> RunGraph(const GraphHandle& graph,
                                                 const std::map<ObjectId, ObjectRef>& inputs,
                                                 std::vector<ObjectId>* handed_over);
  Status Shutdown();
  Status ReportProgress(const JobProgress& progress);
  void Release(ObjectId id);
  bool connected() const { return !closed_; }

 private:
  struct ReadyState {
    Status error;
    std::string inline_data;
    std::string address;
  };

  ObjectRef MakeRef(ObjectId id, const TensorMeta& meta);
  uint64_t NextId() { return (driver_id_ << kIdSequenceBits) | next_sequence_++; }
  Status OnMessage(rpc::ReceivedMessage& message);  // io thread
  void OnObjectsReady(proto::ObjectsReady::Reader ready);
  // Objects this driver handed to a failed run came back unchanged: their references hold them
  // again (a reference already dropped here releases its object).
  void OnHandedBack(proto::HandedBack::Reader back) EXCLUDES(handed_mutex_);
  // When the queued batches go out:
  //   kAwaited  a caller blocks on the answer (a Watch): now.
  //   kSoon     now if nothing was sent for kCoalesceWindow, else at the window's end, so a
  //             lone Submit is not delayed while thousands of them become a few messages.
  //   kLazy     nothing waits on it (a Release): with the next flush, at the latest at the
  //             window's end.
  // "Now" is on the calling thread (waking the io thread to send costs more than the send);
  // the window's end on the io thread. Any thread, holding none of the client's locks.
  enum class FlushWhen { kAwaited, kSoon, kLazy };
  void ScheduleFlush(FlushWhen when) EXCLUDES(flush_mutex_, batch_mutex_);
  // Sends every queued batch, all in one write. Any thread.
  void Flush() EXCLUDES(flush_mutex_, batch_mutex_);
  // Every scheduler interval: closes the connection when the scheduler has been silent past
  // rpc::SchedulerSilenceLimit (stopped, or its host gone), so no call waits on it forever.
  void WatchScheduler();  // io thread
  // Asks the scheduler (once per object) to say when these objects are ready.
  void Watch(const std::vector<ObjectId>& ids);
  // Waits until `id` is ready or failed; returns its state.
  Result<ReadyState> AwaitReady(ObjectId id, int timeout_ms);
  // Waits until `id` is ready or the connection closed: false when `deadline` (if any) passed
  // first.
  bool WaitReady(uint64_t id, std::optional<std::chrono::steady_clock::time_point> deadline)
      REQUIRES(ready_mutex_);

  // Sends the library of each plugin this process loaded that this connection has not sent
  // (LoadPlugin), adding the ops of those loaded since Connect to registry_. Returns them all.
  Result<std::vector<const LoadedPlugin*>> SendPlugins() EXCLUDES(plugins_mutex_);

  rpc::asio::io_context io_;
  rpc::asio::executor_work_guard<rpc::asio::io_context::executor_type> work_;
  std::thread io_thread_;
  std::shared_ptr<rpc::Connection> connection_;
  std::unique_ptr<DataPlane> data_plane_;
  OpRegistry registry_;
  Mutex plugins_mutex_;
  std::set<std::string> plugins_in_registry_ GUARDED_BY(plugins_mutex_);  // sha256s
  std::set<std::string> plugins_sent_ GUARDED_BY(plugins_mutex_);         // sha256s
  Settings settings_;
  std::shared_ptr<Allocator> allocator_ = std::make_shared<AlignedHostAllocator>();
  uint64_t driver_id_ = 0;
  std::atomic<uint64_t> next_sequence_{1};
  std::atomic<bool> closed_{false};
  // Written once, under ready_mutex_, as closed_ is set; read without it once closed_ is seen.
  Status close_reason_;

  Mutex held_mutex_;
  // This driver's Puts, served to workers.
  std::unordered_map<uint64_t, Tensor> held_ GUARDED_BY(held_mutex_);

  Mutex handed_mutex_;
  // References handed to runs (RunGraph's takeOver), by object id, until they come back or go:
  // a failed run may hand them back (OnHandedBack). Expired ones are pruned at each RunGraph.
  std::unordered_map<uint64_t, std::weak_ptr<ObjectRef::State>> handed_ GUARDED_BY(handed_mutex_);

  // Held through a whole Flush, so that batches go out in the order they were taken (a Watch
  // never overtakes the Submit of what it watches) whichever thread flushes.
  Mutex flush_mutex_ ACQUIRED_AFTER(ready_mutex_);
  // The outgoing batches below. Taken after ready_mutex_ where both are held (Watch).
  Mutex batch_mutex_ ACQUIRED_AFTER(ready_mutex_, flush_mutex_);
  std::vector<std::pair<ObjectSpec, std::string>> puts_ GUARDED_BY(batch_mutex_);
  std::vector<std::pair<TaskSpec, std::vector<ObjectSpec>>> submits_ GUARDED_BY(batch_mutex_);
  std::vector<uint64_t> watches_ GUARDED_BY(batch_mutex_);
  std::vector<uint64_t> releases_ GUARDED_BY(batch_mutex_);
  bool flush_timer_armed_ GUARDED_BY(batch_mutex_) = false;
  std::chrono::steady_clock::time_point last_flush_ GUARDED_BY(batch_mutex_);
  std::unique_ptr<rpc::asio::steady_timer> flush_timer_;
  std::unique_ptr<rpc::asio::steady_timer> watchdog_timer_;
  uint32_t scheduler_interval_ms_ = 0;  // from Welcome
  // When the scheduler last sent anything (io thread).
  std::chrono::steady_clock::time_point last_heard_;

  Mutex ready_mutex_;
  CondVar ready_cv_;
  std::unordered_map<uint64_t, ReadyState> ready_ GUARDED_BY(ready_mutex_);
  std::unordered_set<uint64_t> watched_ GUARDED_BY(ready_mutex_);
  std::unordered_map<uint64_t, std::shared_ptr<std::promise<Result<ClusterInfo>>>> status_waiters_
      GUARDED_BY(ready_mutex_);
  std::unordered_map<uint64_t, std::shared_ptr<std::promise<Status>>> reply_waiters_
      GUARDED_BY(ready_mutex_);
  std::unordered_map<uint64_t, std::shared_ptr<std::promise<Result<Timeline>>>> timeline_waiters_
      GUARDED_BY(ready_mutex_);
  uint64_t next_request_ GUARDED_BY(ready_mutex_) = 1;
  // Why the scheduler refused a message of this driver's (it then closes the connection): the
  // close reason, in place of the bare end of the stream.
  Status refused_ GUARDED_BY(ready_mutex_);
};

}  // namespace detail
}  // namespace tessera
