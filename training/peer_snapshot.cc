#include "training/peer_snapshot.h"

#include <algorithm>

#include <fmt/format.h>

namespace tessera {

namespace {

bool IsErrorBuffer(StateKind kind) {
  return kind == StateKind::kWorkerError || kind == StateKind::kServerError;
}

}  // namespace

Result<PeerSnapshot> PeerSnapshot::Take(Trainer& trainer, std::string sampler_state) {
  const StepGraph& step = trainer.step_graph();
  if (step.parallel.tensor_parallel > 1 || step.parallel.sequence_parallel > 1) {
    return InvalidArgument(
        "peer snapshots keep the pieces of a plan without tensor or sequence parallelism; with "
        "--tensor-parallel {} / {} sequence ranks recover from checkpoints (--checkpoint-dir) "
        "instead",
        step.parallel.tensor_parallel, step.parallel.sequence_parallel);
  }
  if (!trainer.parameters_synchronized()) {
    return InvalidArgument(
        "step {} is one of 0/1 Adam's local steps: each rank holds its own parameters until the "
        "synchronisation at step {}; snapshot then",
        trainer.steps_taken(), trainer.NextSynchronizedStep());
  }
  // Each piece's buddy is the next worker of the plan (the next rank of its stage, or the
  // first of the next stage).
  const int workers_in_plan = std::max(1, step.parallel.num_workers());
  const bool buddies = workers_in_plan >= 2 && trainer.PlanWorker(0).valid();
  PeerSnapshot snapshot;
  snapshot.step_ = trainer.steps_taken();
  snapshot.sampler_state_ = std::move(sampler_state);
  snapshot.copies_ = buddies ? 2 : 1;
  std::vector<size_t> indices;
  std::vector<WorkerId> workers;
  for (size_t i = 0; i < step.state.size(); ++i) {
    const StateObject& object = step.state[i];
    // Master copies equal the parameters between steps (the checkpoint's rule too), as 0/1
    // Adam's interval starts do at the synchronised steps snapshots are taken at.
    if (object.kind == StateKind::kMasterParameter || object.kind == StateKind::kIntervalStart) {
      continue;
    }
    const int64_t padded = step.group_numel[object.piece.layer];
    // 1-bit and 0/1 Adam's error buffers are each rank's own, never replicas.
    const bool replica = !IsErrorBuffer(object.kind) && object.piece.rank != 0 &&
                         object.piece.begin == 0 && object.piece.numel == padded;
    if (replica) continue;  // rank 0 holds the same
    Piece piece;
    piece.layer = trainer.model().layers[object.piece.layer].name;
    piece.kind = object.kind;
    piece.padded = padded;
    piece.begin = object.piece.begin;
    piece.numel = object.piece.numel;
    piece.rank = object.piece.rank;
    piece.holder = step.WorkerOf(object.piece);
    indices.push_back(i);
    workers.push_back(piece.holder);
    if (buddies) {
      piece.buddy = trainer.PlanWorker((step.WorkerIndexOf(object.piece) + 1) % workers_in_plan);
      indices.push_back(i);
      workers.push_back(piece.buddy);
    }
    snapshot.bytes_ += 4 * piece.numel;
    snapshot.pieces_.push_back(std::move(piece));
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<Value> copies, trainer.CopyState(indices, workers));
  size_t next = 0;
  for (Piece& piece : snapshot.pieces_) {
    piece.own = std::move(copies.at(next++));
    if (buddies) piece.spare = std::move(copies.at(next++));
  }
  return snapshot;
}

Result<CheckpointInfo> PeerSnapshot::Restore(Trainer& trainer,
                                             const std::set<WorkerId>& dead) const {
  const std::string name = fmt::format("peer snapshot of step {}", step_);
  GatheredState gathered;
  SavedErrors errors;
  for (const Piece& piece : pieces_) {
    struct Copy {
      const Value* value;
      WorkerId worker;
    };
    std::vector<Copy> copies = {{&piece.own, piece.holder}};
    if (piece.spare.defined()) copies.push_back({&piece.spare, piece.buddy});
    // The copy on a worker not known dead first; the other only if that one fails.
    std::stable_partition(copies.begin(), copies.end(),
                          [&](const Copy& copy) { return !dead.contains(copy.worker); });
    std::vector<std::string> failures;
    bool restored = false;
    for (const Copy& copy : copies) {
      Result<Tensor> tensor = trainer.backend().Download(*copy.value);
      if (!tensor.ok()) {
        failures.push_back(
            fmt::format("on {}: {}", copy.worker.ToString(), tensor.status().ToString()));
        continue;
      }
      if (tensor->numel() != piece.numel || tensor->meta().dtype != DType::kF32) {
        return DataLoss("the {} holds {} elements of {} of layer '{}' rank {}, expected {}", name,
                        tensor->numel(), StateKindName(piece.kind), piece.layer, piece.rank,
                        piece.numel);
      }
      if (IsErrorBuffer(piece.kind)) {  // each rank's own (a server error's chunk may be larger
                                        // than a small group)
        (piece.kind == StateKind::kWorkerError ? errors.worker
                                               : errors.server)[piece.layer][piece.rank] =
            std::vector<float>(tensor->data<float>(), tensor->data<float>() + piece.numel);
      } else {
        TESSERA_RETURN_IF_ERROR(gathered.Add(piece.layer, piece.kind, piece.padded, piece.begin,
                                             tensor->data<float>(), piece.numel));
      }
      restored = true;
      break;
    }
    if (!restored) {
      return Unavailable("the {} lost {} of layer '{}' (rank {}): every copy is gone ({})", name,
                         StateKindName(piece.kind), piece.layer, piece.rank,
                         fmt::join(failures, "; "));
    }
  }
  TESSERA_RETURN_IF_ERROR(WriteGathered(trainer, gathered, "the " + name));
  trainer.set_steps_taken(step_);
  TESSERA_RETURN_IF_ERROR(RestoreErrors(trainer, errors, step_)
                              .WithContext("restoring the compressed all-reduces' error buffers"));
  return CheckpointInfo{name, step_, sampler_state_};
}

}  // namespace tessera
