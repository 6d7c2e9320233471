// --trace FILE [--trace-steps N]: the flags train_gpt2 and train_unet3d share to write the last
// training steps' trace (every task, collective and transfer, on every worker) as
// Chrome/Perfetto JSON at the end of a run (client/trace.h).
#pragma once

#include <set>
#include <string>

#include <CLI/CLI.hpp>

#include "client/trace.h"
#include "core/status.h"
#include "training/trainer.h"

namespace tessera::examples {

struct TraceFlags {
  std::string path;  // empty: no trace
  int steps = 2;
};

inline void AddTraceFlags(CLI::App& app, TraceFlags& flags) {
  app.add_option("--trace", flags.path,
                 "At the end, write the last --trace-steps training steps' trace (tasks, "
                 "collectives, transfers on every worker) to this file as Chrome/Perfetto JSON "
                 "(open in ui.perfetto.dev)");
  app.add_option("--trace-steps", flags.steps, "How many of the last steps --trace writes")
      ->check(CLI::PositiveNumber);
}

// Writes the trace when asked; returns a line saying what was written (empty when not asked).
inline Result<std::string> WriteStepTrace(Trainer& trainer, const TraceFlags& flags) {
  if (flags.path.empty()) return std::string();
  TESSERA_ASSIGN_OR_RETURN(Timeline timeline, trainer.StepTimeline(flags.steps));
  if (timeline.spans.empty()) {
    return NotFound("--trace: no step ran, so there is nothing to trace (use --steps >= 1)");
  }
  TESSERA_RETURN_IF_ERROR(WriteChromeTrace(flags.path, timeline).WithContext("--trace"));
  std::set<uint64_t> steps;
  for (const TimelineSpan& span : timeline.spans) steps.insert(span.instance);
  return fmt::format("trace of the last {} step(s) ({} spans, {} process(es)) written to {}",
                     steps.size(), timeline.spans.size(), timeline.processes.size(), flags.path);
}

}  // namespace tessera::examples
