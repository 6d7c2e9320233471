// Measuring what a collective costs between a plan's workers, before planning: the latency and
// bandwidth the planner sizes gradient buckets by (planner/training_plan.h CollectiveLink,
// ChooseGradientBuckets).
//
// A probe graph runs on the workers a plan's data-parallel ranks use: each worker all-reduces a
// small buffer (1 KiB) 8 times, one after the other, then a large one (1 MiB)
// 4 times, through the same runtime path a step's collectives take (graph tasks,
// collective engine, transport). It runs once to set up the communicators, then three times
// timed. Each collective's time is its shortest member span in a run's trace (the member that
// arrived last waited for nobody); a run's latency is its median small collective, its bandwidth
// the extra bytes of a large one over its extra median time; the link is the median run's. The
// probe costs a few tens of milliseconds on one host.
//
// The push link (MeasurePushLink) between two workers, what a pipeline's objects take from one
// stage to the next: a chain of tasks alternating between the two, each reading the one before
// and working 2 ms before passing it on (the `sleep` op; a small buffer, 1 KiB, 17 times; then a
// large one, 1 MiB, 9 times), so every hop is an object pushed to a worker idle for a while, as a
// pipeline stage waits for its input, and its reader dispatched there, through the path a step's
// pushes take. A hop's time is the chain's time (it starts and ends on the first worker,
// one clock) less its tasks' own, over the hops; the latency is a small hop's, the bandwidth the
// extra bytes of a large one over its extra time; once untimed, three times timed, the median
// run's (about 0.2 s of the tasks' work in all).
//
// Thread safety: uses the backend like any caller of it (one call at a time).
#pragma once

#include <vector>

#include "client/graph_backend.h"
#include "core/device.h"
#include "core/ids.h"
#include "core/status.h"
#include "planner/training_plan.h"

namespace tessera {

// The link between `workers` (two or more) for collectives of tensors on `device`. Errors name
// the step that failed ("measuring the collectives' latency: ..."); InvalidArgument for fewer
// than two workers.
Result<CollectiveLink> MeasureCollectiveLink(GraphBackend& backend,
                                             const std::vector<WorkerId>& workers, Device device);

// The push link from `from` to `to` and back (two distinct workers) for objects on `device`.
// Errors name the step that failed ("measuring the push link: ..."); InvalidArgument for one
// worker twice.
Result<CollectiveLink> MeasurePushLink(GraphBackend& backend, WorkerId from, WorkerId to,
                                       Device device);

}  // namespace tessera
