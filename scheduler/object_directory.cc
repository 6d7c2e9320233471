#include "scheduler/object_directory.h"

#include <algorithm>
#include <utility>

#include "core/logging.h"

namespace tessera {

namespace {

template <typename T>
void EraseValue(std::vector<T>& values, const T& value) {
  values.erase(std::remove(values.begin(), values.end(), value), values.end());
}

}  // namespace

ObjectEntry* ObjectDirectory::Find(ObjectId id) {
  return const_cast<ObjectEntry*>(std::as_const(*this).Find(id));
}

const ObjectEntry* ObjectDirectory::Find(ObjectId id) const {
  auto it = objects_.find(id);
  return it == objects_.end() ? nullptr : &it->second;
}

const ObjectEntry& ObjectDirectory::at(ObjectId id) const {
  const ObjectEntry* object = Find(id);
  TESSERA_CHECK(object != nullptr, "{} is not in the object directory", id.ToString());
  return *object;
}

ObjectEntry& ObjectDirectory::Get(ObjectId id) {
  ObjectEntry* object = Find(id);
  TESSERA_CHECK(object != nullptr, "{} is not in the object directory", id.ToString());
  return *object;
}

void ObjectDirectory::Declare(const ObjectSpec& spec, WorkerId driver) {
  ObjectEntry& object = objects_[spec.id];
  object.spec = spec;
  object.driver_refs = 1;
  ++driver_refs_[driver][spec.id.value()];
}

void ObjectDirectory::Revive(const ObjectSpec& spec) {
  TESSERA_CHECK(!objects_.contains(spec.id), "{} revived while it exists", spec.id.ToString());
  objects_[spec.id].spec = spec;
}

void ObjectDirectory::Unseal(ObjectId id) {
  ObjectEntry& object = Get(id);
  TESSERA_CHECK(object.sealed && object.holders.empty() && object.inline_data.empty(),
                "{} unsealed while a copy exists", object.spec.name);
  object.sealed = false;
}

void ObjectDirectory::Put(const ObjectSpec& spec, WorkerId driver, std::string inline_data) {
  const ObjectId id = spec.id;
  Declare(spec, driver);
  ObjectEntry& object = objects_.at(id);
  object.sealed = true;
  object.holders = {driver};
  object.inline_data = std::move(inline_data);
}

std::vector<TaskId> ObjectDirectory::Settle(ObjectEntry& object) {
  for (WorkerId watcher : object.watchers) notify_batches_[watcher].push_back(object.spec.id);
  object.watchers.clear();
  std::vector<TaskId> waiting = std::move(object.waiting_tasks);
  object.waiting_tasks.clear();
  return waiting;
}

void ObjectDirectory::Seal(ObjectId id, WorkerId holder, int64_t bytes, std::string inline_data) {
  ObjectEntry& object = Get(id);
  object.sealed = true;
  object.holders = {holder};
  object.inline_data = std::move(inline_data);
  if (bytes != object.spec.meta.bytes()) {
    GetLogger("scheduler")
        ->warn("{} sealed with {} bytes, declared {}", object.spec.name, bytes,
               object.spec.meta.bytes());
  }
  for (TaskId task : Settle(object)) waiters_->InputSealed(task);
  MaybeFree(id);
}

void ObjectDirectory::Fail(ObjectId id, const Status& error) {
  ObjectEntry& object = Get(id);
  object.error = error;
  object.sealed = false;
  const std::vector<TaskId> waiting = Settle(object);
  const ObjectSpec spec = object.spec;  // the waiters may free the object
  for (TaskId task : waiting) waiters_->InputFailed(task, spec, error);
  MaybeFree(id);
}

void ObjectDirectory::AddUse(ObjectId id) { ++Get(id).pending_uses; }

void ObjectDirectory::ReleaseUse(ObjectId id) {
  ObjectEntry* object = Find(id);
  if (object == nullptr) return;
  --object->pending_uses;
  MaybeFree(id);
}

void ObjectDirectory::AddWaiter(ObjectId id, TaskId task) { Get(id).waiting_tasks.push_back(task); }

void ObjectDirectory::RemoveWaiter(ObjectId id, TaskId task) {
  if (ObjectEntry* object = Find(id)) EraseValue(object->waiting_tasks, task);
}

void ObjectDirectory::MaybeFree(ObjectId id) {
  auto it = objects_.find(id);
  if (it == objects_.end()) return;
  const ObjectEntry& object = it->second;
  if (!object.finished() || object.driver_refs > 0 || object.pending_uses > 0 ||
      !object.waiting_tasks.empty() || !object.watchers.empty()) {
    return;
  }
  for (WorkerId holder : object.holders) free_batches_[holder].push_back(id);
  objects_.erase(it);
  waiters_->ObjectFreed(id);
}

int ObjectDirectory::DriverRefs(WorkerId driver, ObjectId id) const {
  auto refs = driver_refs_.find(driver);
  if (refs == driver_refs_.end()) return 0;
  auto ref = refs->second.find(id.value());
  return ref == refs->second.end() ? 0 : ref->second;
}

void ObjectDirectory::Release(WorkerId driver, ObjectId id) {
  auto refs = driver_refs_.find(driver);
  if (refs == driver_refs_.end()) return;
  auto ref = refs->second.find(id.value());
  if (ref == refs->second.end()) return;  // double release: harmless, ignored
  if (--ref->second == 0) refs->second.erase(ref);
  ObjectEntry* object = Find(id);
  if (object == nullptr) return;
  --object->driver_refs;
  MaybeFree(id);
}

void ObjectDirectory::AddDriverRef(WorkerId driver, ObjectId id) {
  ++Get(id).driver_refs;
  ++driver_refs_[driver][id.value()];
}

void ObjectDirectory::Watch(WorkerId driver, ObjectId id) {
  ObjectEntry* object = Find(id);
  if (object == nullptr || object->finished()) {
    notify_batches_[driver].push_back(id);
  } else {
    object->watchers.push_back(driver);
  }
}

void ObjectDirectory::DriverGone(WorkerId driver) {
  auto refs = driver_refs_.extract(driver);
  if (!refs.empty()) {
    for (const auto& [raw, count] : refs.mapped()) {
      ObjectEntry* object = Find(ObjectId(raw));
      if (object == nullptr) continue;
      object->driver_refs -= count;
      MaybeFree(ObjectId(raw));
    }
  }
  std::vector<ObjectId> held;
  for (auto& [id, object] : objects_) {
    EraseValue(object.watchers, driver);
    if (std::find(object.holders.begin(), object.holders.end(), driver) != object.holders.end()) {
      held.push_back(id);
    }
  }
  for (ObjectId id : held) {
    ObjectEntry* object = Find(id);
    if (object == nullptr) continue;
    EraseValue(object->holders, driver);
    if (object->holders.empty() && object->inline_data.empty()) {
      Fail(id, Unavailable("{} was lost: the driver that put it exited", object->spec.name));
    }
  }
}

std::vector<ObjectId> ObjectDirectory::WorkerGone(WorkerId worker) {
  std::vector<ObjectId> lost;
  for (auto& [id, object] : objects_) {
    auto& holders = object.holders;
    if (std::find(holders.begin(), holders.end(), worker) == holders.end()) continue;
    EraseValue(holders, worker);
    if (holders.empty() && object.sealed && object.inline_data.empty()) lost.push_back(id);
  }
  return lost;
}

std::map<WorkerId, std::vector<ObjectId>> ObjectDirectory::TakeNotifications() {
  return std::exchange(notify_batches_, {});
}

std::map<WorkerId, std::vector<ObjectId>> ObjectDirectory::TakeFrees() {
  return std::exchange(free_batches_, {});
}

}  // namespace tessera
