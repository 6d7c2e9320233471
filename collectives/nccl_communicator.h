// NCCL: the Communicator for device (CUDA) buffers.
//
// Bootstrap: rank 0 creates NCCL's unique id and the Rendezvous carries it to the others (the
// scheduler, inside a cluster: the id travels as a CollectiveJoin message like any blob).
//
// Streams: the communicator has its own CUDA stream. Each call is ordered after the work queued
// so far on the compute stream (an event recorded there, waited on by the communicator's
// stream), runs on the communicator's stream, and the compute stream waits for it in turn (a
// second event). Calls therefore return once enqueued: work queued on the compute stream after
// a call sees its result, and compute queued before it overlaps with nothing it depends on.
// Synchronize() waits for everything enqueued.
//
// Failures: NCCL's communicator is non-blocking (where the library supports it), so formation
// and Synchronize honour the deadline, and Abort (ncclCommAbort) stops a collective stuck on a
// dead peer from any thread. Errors name the rank and NCCL's reason.
//
// NCCL is loaded at run time (dlopen: $TESSERA_NCCL_LIBRARY, else libnccl.so.2 on the loader's
// path and next to the CUDA toolkit), so binaries do not depend on it unless they use it; a
// build without CUDA, a machine without a GPU, or a missing library is an Unavailable error
// saying which.
#pragma once

#include <memory>
#include <string>

#include "collectives/communicator.h"
#include "collectives/rendezvous.h"

namespace tessera {

struct NcclCommunicatorOptions {
  int device = 0;           // CUDA device of this rank
  int timeout_ms = 30'000;  // formation, and Synchronize
};

class DeviceCommunicator : public Communicator {
 public:
  // The stream (a cudaStream_t) collectives are ordered with; nullptr: the legacy default
  // stream.
  virtual void SetComputeStream(void* stream) = 0;
  // The communicator's own stream (a cudaStream_t).
  virtual void* stream() const = 0;
  // Waits for every collective enqueued so far; TimedOut (after aborting the communicator)
  // when they do not finish by the deadline, Unavailable on an NCCL error.
  virtual Status Synchronize() = 0;
};

// NCCL's version as "2.28.9" when the library loads; Unavailable naming why not.
Result<std::string> NcclVersion();

Result<std::unique_ptr<DeviceCommunicator>> ConnectNcclCommunicator(
    Rendezvous& rendezvous, const NcclCommunicatorOptions& options = {});

}  // namespace tessera
