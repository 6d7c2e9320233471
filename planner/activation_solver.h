// The activation solver: for each layer of a chain, keep what its forward saves for its
// backward, keep part of it (the backward recomputing the rest first), recompute it just before
// the backward (whole, or keeping part: the recompute saves less and the backward rebuilds the
// rest), or swap it one tier down and back (a GPU's to the host, a CPU worker's to its swap file
// on the disk; whole, or keeping part: only the part goes down and back, and the backward
// rebuilds the rest), so that the step fits under the compute tier's cap at the least predicted
// step time.
//
// The problem (ActivationProblem) is one worker's chain of layers in forward order, each with
// the bytes its forward saves (s_i), its forward and backward times (f_i, b_i), the partial keeps
// its op offers (p_i bytes kept, r_i time to rebuild the rest: OpDef::rebuild_options), the
// device bytes live besides the saved objects while each forward and each backward runs (from
// the memory model, planner/memory_model.h), the cap, and the link's bandwidth to the tier below.
// The step runs F_1 .. F_n, then B_n .. B_1.
//
// The cost model (what EvaluateActivationPlan computes for any choices, and the solver
// minimises):
//   * memory (objects and kernel scratch, as the memory model counts them): while F_j or B_j
//     runs, the device holds its base bytes, what layer j's forward saves (being made, or back for
//     its backward: s_j; under a partial keep p_j of it is saved and the rest is the kernels'
//     scratch, rebuilt by the backward: s_j all the same where the cap counts scratch, else
//     p_j), every earlier layer's s_i it keeps or
//     p_i it keeps part of (c_i copies of it: micro-batches in flight), c_j - 1 copies of what
//     layer j keeps, and what layer j-1 swaps when it does (s_{j-1}, or p_{j-1} swapping part: its
//     copy down overlaps F_j; its copy up, prefetched one layer ahead, overlaps B_j). A recompute
//     of layer j runs just before B_j and holds what B_j does and o_j (counted at B_j). The peak is
//     the largest of these sums. (With c > 1, the other micro-batches' later layers are not counted
//     at F_j: a pipeline stage's peak is at its first backward, where they are.)
//   * time: the forwards and backwards, plus f_j for each recomputed layer, r_j for each layer
//     kept in part (also for a recompute or a swap keeping part), plus each swapped layer's
//     transfer time not hidden under compute: the copy down (s_j or p_j / bandwidth) overlaps
//     F_{j+1}, the copy up overlaps B_{j+1} (none after the last layer, so swapping it buys
//     nothing and costs both copies), and what the two copies take from the compute beside them
//     (the bytes times copy_compute_us_per_byte, twice: a CPU worker's processor does part of
//     the I/O).
// Both constraints at F_j and B_j depend only on the bytes kept before j, on layer j's choice and
// on what layer j-1's swap holds, so a dynamic programme over the layers whose state is (bytes
// kept so far, bytes the previous layer's swap holds), keeping only the states no other beats on
// both bytes and time, finds the optimum of the model exactly (tests: against brute force on
// chains of up to 16 layers).
//
// Thread safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace tessera {

enum class ActivationChoice : uint8_t { kKeep, kKeepPart, kRecompute, kSwap };
const char* ActivationChoiceName(ActivationChoice choice);

// One way to keep part of what a layer saves (its forward op's attribute "rebuild").
struct PartialKeep {
  std::string rebuild;     // the option, as the op names it
  int64_t kept_bytes = 0;  // what the forward then saves (p_i)
  double rebuild_us = 0;   // what the backward repeats first (r_i)
};

struct ActivationLayer {
  int64_t saved_bytes = 0;  // what its forward keeps for its backward (s_i)
  double forward_us = 0;    // f_i
  double backward_us = 0;   // b_i
  bool must_keep = false;   // a layer the plan cannot recompute or swap (still constrains memory)
  std::vector<PartialKeep> partial_keeps;
  // How many micro-batches' copies of what it keeps are live at once (c_i: a pipeline stage's
  // micro-batches in flight; else 1).
  int64_t kept_copies = 1;
  // What a recompute of it makes besides what it saves (its outputs again, read by no one: o_i),
  // live while the recompute runs, just before B_i.
  int64_t recompute_bytes = 0;
};

// What the plan does with one layer's saved activations.
struct ActivationDecision {
  ActivationChoice choice = ActivationChoice::kKeep;
  // kKeepPart, and kRecompute or kSwap keeping part: the PartialKeep's option (else empty).
  std::string rebuild;
  // Under a plan that splits backwards (zero-bubble schedules): the layer's backward runs whole,
  // so what its forward saved is freed with its input gradient instead of waiting for a deferred
  // weight half (the memory plan's choice under a cap; planner/memory_plan.cc).
  bool whole_backward = false;
  bool operator==(const ActivationDecision&) const = default;
};
// How many of `decisions` make `choice`.
int CountChoice(const std::vector<ActivationDecision>& decisions, ActivationChoice choice);

struct ActivationProblem {
  std::vector<ActivationLayer> layers;  // forward order
  // Device bytes live besides the layers' saved objects while layer j's forward runs, and while
  // its backward runs (inputs, outputs, parameters, gradients, the stream between layers). Empty:
  // none.
  std::vector<int64_t> base_forward_bytes, base_backward_bytes;
  int64_t cap_bytes = 0;         // the device tier's cap
  double link_bytes_per_us = 0;  // to the tier below and back, each way; 0: no swapping
  // The compute time each byte copied down or up takes, hidden or not (a CPU worker's swap file:
  // the processor's part of the I/O, MemoryCaps::disk_copy_compute_us_per_byte); 0: none.
  double copy_compute_us_per_byte = 0;
  bool allow_recompute = true;
  bool allow_swap = true;
  // Whether the cap counts kernel scratch (a tier's cap does: what a partial keep rebuilds is
  // held while its layer runs; an activation budget counts activations, objects, alone).
  bool cap_counts_scratch = true;

  // InvalidArgument naming the field: negative sizes or times, a partial keep no smaller than
  // what it keeps part of, base vectors of the wrong size, a non-positive cap.
  Status Validate() const;
};

struct ActivationPlan {
  std::vector<ActivationDecision> decisions;  // per layer
  double step_us = 0;                         // predicted step time
  int64_t peak_bytes = 0;                     // predicted device peak
  bool fits = false;                          // peak_bytes <= cap_bytes
  int Count(ActivationChoice choice) const;
};

// The cost model's step time and peak for any decisions (one per layer).
// REQUIRES: problem.Validate() is ok, decisions.size() == problem.layers.size(), and each
// decision's rebuild, when set, names one of its layer's partial keeps.
ActivationPlan EvaluateActivationPlan(const ActivationProblem& problem,
                                      std::vector<ActivationDecision> decisions);

// The decisions with the least predicted step time whose peak fits under the cap. Infeasible
// when none fits, with the smallest peak the allowed choices reach, the cap, and what to change.
Result<ActivationPlan> SolveActivations(const ActivationProblem& problem);

// "keep 5, keep part 1, recompute 6, swap 0: h.0 keep, h.1 keep part (norms_gelu), h.2
// recompute, h.3 recompute (norms_gelu), ..." with layer names.
std::string DescribeActivationPlan(const ActivationPlan& plan,
                                   const std::vector<std::string>& layer_names);

}  // namespace tessera
