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

}  // namespace tessera
