#include "scheduler/waits.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace tessera {
namespace {

std::string Seconds(std::chrono::milliseconds ms) {
  return fmt::format("{:.1f} s", static_cast<double>(ms.count()) / 1000.0);
}

std::string CollectiveName(const ReportedWait::Collective& c) {
  return fmt::format("collective {}/{}", c.collective, c.op);
}

// A peer's own report, in a few words ("it is in collective 8/all_gather").
std::string Briefly(const ReportedWait& reported) {
  if (reported.collective.has_value()) return "it is in " + CollectiveName(*reported.collective);
  if (!reported.running.empty()) return "it runs " + reported.running.front();
  if (!reported.awaited.empty()) return "it waits for " + reported.awaited.front().name;
  return "it is idle";
}

class Explainer {
 public:
  Explainer(const std::vector<WorkerWaitInput>& workers,
            const std::function<std::optional<GroupView>(uint64_t)>& group,
            std::chrono::milliseconds silent_after)
      : group_(group), silent_after_(silent_after) {
    for (const WorkerWaitInput& worker : workers) by_id_[worker.id] = &worker;
  }

  // Why `peer` holds others up, if it does for want of an answer: "which has not answered for
  // 2.1 s"; empty when it answers.
  std::string Silence(WorkerId peer) const {
    auto found = by_id_.find(peer);
    if (found == by_id_.end()) return "which is not connected";
    const WorkerWaitInput& input = *found->second;
    if (!input.alive) return "which is dead";
    if (input.silent > silent_after_) {
      return fmt::format("which has not answered for {}", Seconds(input.silent));
    }
    return {};
  }

  std::string Describe(const WorkerWaitInput& self, std::vector<WorkerId>& blocked) const {
    const ReportedWait& r = self.reported;
    if (r.collective.has_value()) return DescribeCollective(self, *r.collective, blocked);
    if (!r.running.empty()) return fmt::format("runs {}", fmt::join(r.running, ", "));
    if (!r.awaited.empty()) {
      std::vector<std::string> objects;
      for (const ReportedWait::Awaited& object : r.awaited) {
        if (!object.producer.valid()) {
          objects.push_back(object.name);
          continue;
        }
        std::string text = fmt::format("{} from {}", object.name, object.producer.ToString());
        if (std::string silence = Silence(object.producer); !silence.empty()) {
          text += ", " + silence;
          if (std::find(blocked.begin(), blocked.end(), object.producer) == blocked.end()) {
            blocked.push_back(object.producer);
          }
        }
        objects.push_back(std::move(text));
      }
      return fmt::format("waits for {}", fmt::join(objects, "; "));
    }
    if (!r.instance.empty()) {
      // Nothing on the CPU, no input awaited, no collective in progress: what is left are its
      // collective members, queued behind the communication stream's order.
      return fmt::format(
          "in graph instance {}: no kernel running, no input awaited (its collective members wait "
          "their turn)",
          r.instance);
    }
    if (self.tasks_in_flight > 0) {
      return fmt::format("has {} task(s) dispatched", self.tasks_in_flight);
    }
    return "idle";
  }

 private:
  std::string DescribeCollective(const WorkerWaitInput& self, const ReportedWait::Collective& c,
                                 std::vector<WorkerId>& blocked) const {
    std::string text = fmt::format("waits in {} (rank {} of {}", CollectiveName(c), c.rank, c.size);
    if (!c.task.empty()) text += ", task " + c.task;
    text +=
        fmt::format(", {} so far)", Seconds(std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::microseconds(c.since_us))));
    std::optional<GroupView> view = group_(c.group);
    std::vector<std::string> reasons;
    std::vector<std::string> peers;
    if (view.has_value()) {
      for (WorkerId peer : view->members) {
        if (peer == self.id) continue;
        peers.push_back(peer.ToString());
        const bool not_joined =
            c.forming && std::find(view->missing_joins.begin(), view->missing_joins.end(), peer) !=
                             view->missing_joins.end();
        if (std::string silence = Silence(peer); !silence.empty()) {
          reasons.push_back(fmt::format("for {}, {}", peer.ToString(), silence));
          blocked.push_back(peer);
          continue;
        }
        const WorkerWaitInput& input = *by_id_.at(peer);
        const auto& theirs = input.reported.collective;
        const bool elsewhere =
            !theirs.has_value() || theirs->group != c.group || theirs->collective != c.collective;
        if (not_joined || (!c.forming && elsewhere)) {
          reasons.push_back(fmt::format("for {}, which has not reached it ({})", peer.ToString(),
                                        Briefly(input.reported)));
          blocked.push_back(peer);
        }
      }
    }
    if (!reasons.empty()) {
      text += fmt::format(" {}", fmt::join(reasons, " and "));
    } else if (c.forming) {
      text += ": forming the group";
    } else if (!peers.empty()) {
      text += fmt::format(" with {}", fmt::join(peers, ", "));
    }
    if (!self.reported.running.empty()) {
      text += fmt::format("; computing {}", fmt::join(self.reported.running, ", "));
    }
    return text;
  }

  const std::function<std::optional<GroupView>(uint64_t)>& group_;
  const std::chrono::milliseconds silent_after_;
  std::map<WorkerId, const WorkerWaitInput*> by_id_;
};

}  // namespace

ReportedWait ReadWaitState(proto::WaitState::Reader wire) {
  ReportedWait reported;
  for (capnp::Text::Reader name : wire.getRunning()) reported.running.emplace_back(name.cStr());
  for (proto::AwaitedObject::Reader object : wire.getAwaited()) {
    reported.awaited.push_back({object.getName().cStr(), WorkerId(object.getProducer())});
  }
  reported.instance = wire.getInstance().cStr();
  if (wire.hasCollective() && wire.getCollective().getTask().size() > 0) {
    proto::CollectiveWait::Reader c = wire.getCollective();
    reported.collective = ReportedWait::Collective{.task = c.getTask().cStr(),
                                                   .op = c.getOp().cStr(),
                                                   .collective = c.getCollective(),
                                                   .group = c.getGroup(),
                                                   .rank = c.getRank(),
                                                   .size = c.getSize(),
                                                   .forming = c.getForming(),
                                                   .since_us = c.getSinceMicros()};
  }
  return reported;
}

std::vector<WorkerWaitLine> ExplainWaits(
    const std::vector<WorkerWaitInput>& workers,
    const std::function<std::optional<GroupView>(uint64_t)>& group,
    std::chrono::milliseconds silent_after) {
  Explainer explainer(workers, group, silent_after);
  std::vector<WorkerWaitLine> lines;
  for (const WorkerWaitInput& worker : workers) {
    WorkerWaitLine line{.worker = worker.id};
    if (!worker.alive) {
      line.text = "dead";
    } else if (worker.silent > silent_after) {
      line.text = fmt::format("not responding (last heartbeat {} ms ago); it said: {}",
                              worker.silent.count(), explainer.Describe(worker, line.blocked_on));
    } else {
      line.text = explainer.Describe(worker, line.blocked_on);
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace tessera
