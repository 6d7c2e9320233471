// ObjectDirectory: every cluster object the scheduler knows, where it lives and who needs it.
//
// An object is
//   - created by a driver's Put (held by that driver, sealed at once) or declared as the output
//     of a task or a graph instance (sealed later, held by the worker that produced it);
//   - referenced by the driver that created it until that driver releases it (the directory
//     counts references per driver, so a departing driver's references go with it), and by every
//     task or instance that will read it (pending uses);
//   - watched by drivers waiting for it, and waited for by tasks whose input it is;
//   - freed on its holders once it is finished (sealed or failed) and nothing references,
//     watches or waits for it.
// Small objects (<= inline_object_bytes) carry their bytes here (inline_data) and travel inside
// control messages; larger ones move peer to peer: the directory only says who holds them.
//
// Tasks: the directory stores only the ids of the tasks waiting for an object. When the object
// is sealed or fails it tells its ObjectWaiters (the task table) about each of them, and only
// then frees the object if nothing needs it any more. A waiter may re-enter the directory (fail
// objects, release uses): the directory holds no reference across those calls.
//
// Outgoing: watchers to tell and holders to free accumulate per participant until the core
// takes them (TakeNotifications, TakeFrees) and sends them in one message each.
//
// Thread safety: none; the scheduler's io thread drives it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/graph.h"
#include "core/ids.h"
#include "core/status.h"

namespace tessera {

struct ObjectEntry {
  ObjectSpec spec;
  bool sealed = false;
  std::vector<WorkerId> holders;
  std::string inline_data;
  Status error;  // set when the object failed or was lost
  int driver_refs = 0;
  int pending_uses = 0;
  std::vector<WorkerId> watchers;
  std::vector<TaskId> waiting_tasks;
  bool finished() const { return sealed || !error.ok(); }
};

// Told about the tasks waiting for an object when it is settled (implemented by the task table).
class ObjectWaiters {
 public:
  virtual ~ObjectWaiters() = default;
  // An object `task` was waiting for was sealed.
  virtual void InputSealed(TaskId task) = 0;
  // `object`, which `task` was waiting for, failed with `error`.
  virtual void InputFailed(TaskId task, const ObjectSpec& object, const Status& error) = 0;
  // The object left the directory (freed).
  virtual void ObjectFreed(ObjectId /*object*/) {}
};

class ObjectDirectory {
 public:
  // `waiters` must outlive the directory; it is not called during construction.
  explicit ObjectDirectory(ObjectWaiters* waiters) : waiters_(waiters) {}

  size_t size() const { return objects_.size(); }
  bool contains(ObjectId id) const { return objects_.contains(id); }
  // nullptr for an unknown (never created, or freed) object.
  ObjectEntry* Find(ObjectId id);
  const ObjectEntry* Find(ObjectId id) const;
  // REQUIRES: known.
  const ObjectEntry& at(ObjectId id) const;

  // Creation. The callers check that the id is valid and new (the error texts are theirs).
  //
  // An object a task or graph instance will produce: not sealed, referenced once by `driver`.
  void Declare(const ObjectSpec& spec, WorkerId driver);
  // A driver's Put: sealed at once, held by the driver and referenced once by it.
  void Put(const ObjectSpec& spec, WorkerId driver, std::string inline_data);
  // An object that was freed, needed again to rebuild another (lineage): declared, referenced by
  // nobody, freed once sealed unless something uses it by then. REQUIRES: not known.
  void Revive(const ObjectSpec& spec);
  // A lost object (sealed, no copy left) that its task will make again: waited for like any
  // object not sealed yet. REQUIRES: known, sealed, no holder and no inline copy.
  void Unseal(ObjectId id);

  // Settling. Each tells the watchers and the waiting tasks, then frees the object if nothing
  // needs it. REQUIRES: known.
  //
  // Sealed by `holder` with `bytes` (a warning is logged when they differ from the declared size).
  void Seal(ObjectId id, WorkerId holder, int64_t bytes, std::string inline_data);
  // Failed or lost: whoever asks for it gets `error`.
  void Fail(ObjectId id, const Status& error);

  // A task or instance will read the object (REQUIRES: known) / no longer will (nothing for an
  // unknown object).
  void AddUse(ObjectId id);
  void ReleaseUse(ObjectId id);
  // `task` waits for the object to be sealed (REQUIRES: known) / no longer does.
  void AddWaiter(ObjectId id, TaskId task);
  void RemoveWaiter(ObjectId id, TaskId task);

  // How many references `driver` holds to the object (0 for an unknown one).
  int DriverRefs(WorkerId driver, ObjectId id) const;
  // The driver drops one reference. A release the driver does not hold is ignored.
  void Release(WorkerId driver, ObjectId id);
  // The driver holds one more reference (an object it handed to a run came back). REQUIRES:
  // known, and the driver connected (DriverGone not called for it).
  void AddDriverRef(WorkerId driver, ObjectId id);
  // The driver wants to hear when the object is finished: queued at once when it already is (or
  // is unknown: the driver is told so), else when it is settled.
  void Watch(WorkerId driver, ObjectId id);
  // The driver's connection is gone: its references and watches go, and so do the objects only
  // it held (its Puts), which fail for whoever still needs them.
  void DriverGone(WorkerId driver);
  // A worker died: it holds nothing any more. Returns the sealed objects that were held only
  // there and carry no inline copy: they are lost, and the caller fails them.
  std::vector<ObjectId> WorkerGone(WorkerId worker);

  // Objects whose watchers are to be told, by watcher, since the last call.
  std::map<WorkerId, std::vector<ObjectId>> TakeNotifications();
  // Freed objects to delete on their holders, by holder, since the last call.
  std::map<WorkerId, std::vector<ObjectId>> TakeFrees();
  // Drops what was queued for `who` (its connection is gone, or it died).
  void DropNotifications(WorkerId who) { notify_batches_.erase(who); }
  void DropFrees(WorkerId who) { free_batches_.erase(who); }

 private:
  ObjectEntry& Get(ObjectId id);
  // Queues the watchers' notifications and returns the waiting tasks, clearing both.
  std::vector<TaskId> Settle(ObjectEntry& object);
  // Frees the object (queues it on its holders) if it is finished and nothing needs it.
  void MaybeFree(ObjectId id);

  ObjectWaiters* waiters_;
  std::unordered_map<ObjectId, ObjectEntry> objects_;
  // Per driver: the objects it references, with counts (their sum per object is driver_refs).
  std::map<WorkerId, std::unordered_map<uint64_t, int>> driver_refs_;
  std::map<WorkerId, std::vector<ObjectId>> notify_batches_;
  std::map<WorkerId, std::vector<ObjectId>> free_batches_;
};

}  // namespace tessera
