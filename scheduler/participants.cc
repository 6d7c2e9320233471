#include "scheduler/participants.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "core/crypto.h"
#include "core/logging.h"
#include "core/rpc/wire.h"

namespace tessera {

ParticipantTable::ParticipantTable(std::string token, std::string session_dir)
    : token_(std::move(token)), session_dir_(std::move(session_dir)) {}

WorkerId ParticipantTable::Accept(Clock::time_point now) {
  const WorkerId id(next_id_++);
  Participant participant;
  participant.id = id;
  participant.last_heard = now;
  participants_.emplace(id, std::move(participant));
  return id;
}

Participant* ParticipantTable::Find(WorkerId id) {
  return const_cast<Participant*>(std::as_const(*this).Find(id));
}

const Participant* ParticipantTable::Find(WorkerId id) const {
  auto it = participants_.find(id);
  return it == participants_.end() ? nullptr : &it->second;
}

void ParticipantTable::Remove(WorkerId id) {
  // (A departed worker keeps its last figures, CPU time and store included; MarkDead zeroes only
  // the scheduler's own load on it.)
  auto it = participants_.find(id);
  if (it == participants_.end()) return;
  if (it->second.role == ParticipantRole::kWorker) {
    Participant& gone = departed_.emplace_back(std::move(it->second));
    MarkDead(gone);
    gone.waits = ReportedWait{};
    if (departed_.size() > kDepartedKept) departed_.pop_front();
  }
  participants_.erase(it);
}

Status ParticipantTable::Hello(Participant& from, proto::Hello::Reader hello) {
  if (hello.getProtocolVersion() != rpc::kProtocolVersion) {
    return InvalidArgument("protocol version {} is not the scheduler's {}",
                           hello.getProtocolVersion(), rpc::kProtocolVersion);
  }
  if (!ConstantTimeEquals(rpc::ToString(hello.getToken()), token_)) {
    GetLogger("scheduler")
        ->warn("refused {} from pid {} on {}: invalid token", from.id.ToString(), hello.getPid(),
               rpc::ToString(hello.getHostname()));
    return Unavailable(
        "invalid cluster token: pass the token the head printed (or its file {}/token)",
        session_dir_);
  }
  switch (hello.getRole()) {
    case proto::Role::WORKER:
      from.role = ParticipantRole::kWorker;
      break;
    case proto::Role::DRIVER:
      from.role = ParticipantRole::kDriver;
      break;
    default:
      from.role = ParticipantRole::kAdmin;
      break;
  }
  from.hostname = rpc::ToString(hello.getHostname());
  from.pid = hello.getPid();
  from.data_address = rpc::ToString(hello.getDataAddress());
  from.cpu_threads = hello.getCpuThreads();
  from.gpu = rpc::ToString(hello.getGpu());
  from.cpus = rpc::ToString(hello.getCpus());
  from.host_capacity = hello.getHostCapacity();
  from.alive = true;
  return Status::Ok();
}

void ParticipantTable::Heartbeat(Participant& worker, proto::Heartbeat::Reader heartbeat) {
  worker.host_used = heartbeat.getHostUsed();
  worker.spilled_bytes = heartbeat.getSpilledBytes();
  worker.spilled_total = heartbeat.getSpilledTotal();
  worker.tasks_done = heartbeat.getTasksDone();
  worker.bytes_pulled = heartbeat.getBytesPulled();
  worker.pull_micros = heartbeat.getPullMicros();
  worker.bytes_served = heartbeat.getBytesServed();
  // Figures off the wire: what cannot be true (negative, not finite) counts as nothing.
  const auto at_least_zero = [](double value) {
    return std::isfinite(value) && value > 0 ? value : 0.0;
  };
  worker.cpu_seconds = at_least_zero(heartbeat.getCpuSeconds());
  worker.cpu_utilization = at_least_zero(heartbeat.getCpuUtilization());
  worker.gpu_use.reset();
  if (heartbeat.hasGpu()) {
    const proto::GpuUse::Reader gpu = heartbeat.getGpu();
    GpuUse& use = worker.gpu_use.emplace();
    use.utilization = std::min(at_least_zero(gpu.getUtilization()), 1.0);
    use.memory_total = std::max<int64_t>(0, gpu.getMemoryTotal());
    use.memory_used = std::clamp<int64_t>(gpu.getMemoryUsed(), 0, use.memory_total);
  }
  worker.objects = std::max<int64_t>(0, heartbeat.getObjects());
  worker.device_bytes = std::max<int64_t>(0, heartbeat.getDeviceBytes());
  worker.restores = std::max<int64_t>(0, heartbeat.getRestores());
  worker.waits = ReadWaitState(heartbeat.getWaits());
  if (heartbeat.getHostCapacity() > 0) worker.host_capacity = heartbeat.getHostCapacity();
}

namespace {

// A cumulative figure plus one a worker reported (off the wire): a negative report counts as
// nothing, and the sum stops at the largest int64 instead of overflowing.
int64_t AddReported(int64_t total, int64_t reported) {
  if (reported <= 0) return total;
  return total > std::numeric_limits<int64_t>::max() - reported
             ? std::numeric_limits<int64_t>::max()
             : total + reported;
}

}  // namespace

void ParticipantTable::RecordRun(Participant& worker, proto::RunReport::Reader report) {
  worker.last_run = std::make_unique<capnp::MallocMessageBuilder>();
  worker.last_run->setRoot(report);
  ++worker.instances_finished;
  worker.bytes_pushed = AddReported(worker.bytes_pushed, report.getPushedBytes());
  worker.collective_bytes_sent =
      AddReported(worker.collective_bytes_sent, report.getCollectiveBytesSent());
}

std::vector<WorkerId> ParticipantTable::Expired(Clock::time_point now,
                                                std::chrono::milliseconds timeout) const {
  std::vector<WorkerId> expired;
  for (const auto& [id, p] : participants_) {
    if (p.role == ParticipantRole::kWorker && p.alive && now - p.last_heard > timeout)
      expired.push_back(id);
  }
  return expired;
}

void ParticipantTable::MarkDead(Participant& worker) {
  worker.alive = false;
  worker.tasks_in_flight = 0;
  worker.committed_bytes = 0;
}

void ParticipantTable::AddLoad(WorkerId worker, int64_t memory_bytes) {
  Participant* p = Find(worker);
  TESSERA_CHECK(p != nullptr, "load added to unknown {}", worker.ToString());
  ++p->tasks_in_flight;
  p->committed_bytes += memory_bytes;
}

void ParticipantTable::RemoveLoad(WorkerId worker, int64_t memory_bytes) {
  // A dead worker's load was cleared when it died; its tasks failing later take nothing off.
  if (Participant* p = Find(worker); p != nullptr && p->alive) {
    --p->tasks_in_flight;
    p->committed_bytes -= memory_bytes;
  }
}

std::vector<WorkerLoad> ParticipantTable::WorkerLoads() const {
  std::vector<WorkerLoad> loads;
  for (const auto& [id, p] : participants_) {
    if (p.role != ParticipantRole::kWorker) continue;
    loads.push_back(WorkerLoad{id, p.alive, p.host_capacity - p.host_used - p.committed_bytes,
                               p.tasks_in_flight});
  }
  return loads;
}

std::vector<WorkerId> ParticipantTable::AliveWorkers() const {
  std::vector<WorkerId> alive;
  for (const auto& [id, p] : participants_) {
    if (p.role == ParticipantRole::kWorker && p.alive) alive.push_back(id);
  }
  return alive;
}

int ParticipantTable::alive_workers() const { return static_cast<int>(AliveWorkers().size()); }

std::string ParticipantTable::Describe(WorkerId id) const {
  const Participant* p = Find(id);
  if (p == nullptr) return id.ToString();
  return fmt::format("{} (pid {} on {})", id.ToString(), p->pid, p->hostname);
}

const std::string& ParticipantTable::DataAddress(WorkerId id) const {
  const Participant* p = Find(id);
  TESSERA_CHECK(p != nullptr, "no address for unknown {}", id.ToString());
  return p->data_address;
}

}  // namespace tessera
