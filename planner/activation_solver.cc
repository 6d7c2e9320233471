#include "planner/activation_solver.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <fmt/format.h>

namespace tessera {

const char* ActivationChoiceName(ActivationChoice choice) {
  switch (choice) {
    case ActivationChoice::kKeep:
      return "keep";
    case ActivationChoice::kKeepPart:
      return "keep part";
    case ActivationChoice::kRecompute:
      return "recompute";
    case ActivationChoice::kSwap:
      return "swap";
  }
  return "?";
}

Status ActivationProblem::Validate() const {
  const size_t n = layers.size();
  for (size_t i = 0; i < n; ++i) {
    const ActivationLayer& layer = layers[i];
    if (layer.saved_bytes < 0 || layer.forward_us < 0 || layer.backward_us < 0 ||
        !std::isfinite(layer.forward_us) || !std::isfinite(layer.backward_us)) {
      return InvalidArgument(
          "activation layer {}: saved bytes {} and times {} / {} us must be finite and >= 0", i,
          layer.saved_bytes, layer.forward_us, layer.backward_us);
    }
    if (layer.kept_copies < 1) {
      return InvalidArgument("activation layer {}: kept_copies must be >= 1, not {}", i,
                             layer.kept_copies);
    }
    for (const PartialKeep& part : layer.partial_keeps) {
      if (part.kept_bytes < 0 || part.kept_bytes >= layer.saved_bytes || part.rebuild_us < 0 ||
          !std::isfinite(part.rebuild_us)) {
        return InvalidArgument(
            "activation layer {}: partial keep '{}' keeps {} of {} bytes and rebuilds in {} us; it "
            "must keep less than the whole, in a finite time >= 0",
            i, part.rebuild, part.kept_bytes, layer.saved_bytes, part.rebuild_us);
      }
    }
  }
  for (const auto* base : {&base_forward_bytes, &base_backward_bytes}) {
    if (!base->empty() && base->size() != n) {
      return InvalidArgument("base bytes: {} entries for {} layers (one per layer, or none)",
                             base->size(), n);
    }
    for (int64_t bytes : *base) {
      if (bytes < 0) return InvalidArgument("base bytes must be >= 0, not {}", bytes);
    }
  }
  if (cap_bytes <= 0) return InvalidArgument("the device cap must be > 0 bytes, not {}", cap_bytes);
  if (link_bytes_per_us < 0 || !std::isfinite(link_bytes_per_us)) {
    return InvalidArgument("the link's bandwidth must be finite and >= 0, not {}",
                           link_bytes_per_us);
  }
  if (copy_compute_us_per_byte < 0 || !std::isfinite(copy_compute_us_per_byte)) {
    return InvalidArgument("the compute time a copied byte takes must be finite and >= 0, not {}",
                           copy_compute_us_per_byte);
  }
  return Status::Ok();
}

int CountChoice(const std::vector<ActivationDecision>& decisions, ActivationChoice choice) {
  return static_cast<int>(std::count_if(decisions.begin(), decisions.end(),
                                        [choice](const auto& d) { return d.choice == choice; }));
}

int ActivationPlan::Count(ActivationChoice choice) const { return CountChoice(decisions, choice); }

namespace {

int64_t Base(const std::vector<int64_t>& base, size_t j) { return base.empty() ? 0 : base[j]; }

// One layer's choice as the programme sees it: a partial keep by index.
struct Option {
  ActivationChoice choice = ActivationChoice::kKeep;
  int part = -1;  // kKeepPart, kRecompute, kSwap: index in the layer's partial_keeps (or none)
};

// The options layer j may take.
std::vector<Option> OptionsOf(const ActivationProblem& problem, size_t j) {
  const ActivationLayer& layer = problem.layers[j];
  std::vector<Option> options = {Option{}};
  if (layer.must_keep) return options;
  for (size_t k = 0; k < layer.partial_keeps.size(); ++k) {
    options.push_back(Option{ActivationChoice::kKeepPart, static_cast<int>(k)});
  }
  if (problem.allow_recompute) {
    options.push_back(Option{ActivationChoice::kRecompute});
    for (size_t k = 0; k < layer.partial_keeps.size(); ++k) {
      options.push_back(Option{ActivationChoice::kRecompute, static_cast<int>(k)});
    }
  }
  if (problem.allow_swap && problem.link_bytes_per_us > 0) {
    options.push_back(Option{ActivationChoice::kSwap});
    for (size_t k = 0; k < layer.partial_keeps.size(); ++k) {
      options.push_back(Option{ActivationChoice::kSwap, static_cast<int>(k)});
    }
  }
  return options;
}

Option OptionOf(const ActivationLayer& layer, const ActivationDecision& decision) {
  Option option{decision.choice};
  if (decision.rebuild.empty()) return option;
  for (size_t k = 0; k < layer.partial_keeps.size(); ++k) {
    if (layer.partial_keeps[k].rebuild == decision.rebuild) option.part = static_cast<int>(k);
  }
  TESSERA_CHECK(option.part >= 0, "no partial keep '{}' on this layer", decision.rebuild);
  return option;
}

// The bytes layer j holds from its forward until its backward under `option`.
int64_t KeptBytes(const ActivationLayer& layer, const Option& option) {
  switch (option.choice) {
    case ActivationChoice::kKeep:
      return layer.saved_bytes;
    case ActivationChoice::kKeepPart:
      return layer.partial_keeps[static_cast<size_t>(option.part)].kept_bytes;
    case ActivationChoice::kRecompute:
    case ActivationChoice::kSwap:
      return 0;
  }
  return 0;
}

// The bytes of what layer j's forward saves under `option` (and, recomputed, its recompute;
// swapped, what is copied down and back).
int64_t MadeBytes(const ActivationLayer& layer, const Option& option) {
  return option.part >= 0 ? layer.partial_keeps[static_cast<size_t>(option.part)].kept_bytes
                          : layer.saved_bytes;
}

// What layer j holds while its own forward or backward runs: what it saves, and under a partial
// keep, where the cap counts scratch, also what its kernels rebuild (the rest of s_j: the
// forward makes it, and the backward makes it again first).
int64_t RunningBytes(const ActivationProblem& problem, const ActivationLayer& layer,
                     const Option& option) {
  return option.part >= 0 && problem.cap_counts_scratch ? layer.saved_bytes
                                                        : MadeBytes(layer, option);
}

// What a recompute under `option` makes besides what it saves, live just before B_j.
int64_t RecomputeBytes(const ActivationLayer& layer, const Option& option) {
  return option.choice == ActivationChoice::kRecompute ? layer.recompute_bytes : 0;
}

// What the backward repeats first under `option`: a partial keep's rebuild (else nothing).
double RebuildTime(const ActivationLayer& layer, const Option& option) {
  return option.part >= 0 ? layer.partial_keeps[static_cast<size_t>(option.part)].rebuild_us : 0;
}

// The bytes layer j's option leaves in memory while the next layer's forward runs: a swapped
// layer's saved objects, until their copy down is done.
int64_t InFlightBytes(const ActivationLayer& layer, const Option& option) {
  return option.choice == ActivationChoice::kSwap ? MadeBytes(layer, option) : 0;
}

// The time layer j's option adds to the forwards and backwards.
double ExtraTime(const ActivationProblem& problem, size_t j, const Option& option) {
  const std::vector<ActivationLayer>& layers = problem.layers;
  switch (option.choice) {
    case ActivationChoice::kKeep:
      return 0;
    case ActivationChoice::kKeepPart:
      return RebuildTime(layers[j], option);
    case ActivationChoice::kRecompute:
      return layers[j].forward_us + RebuildTime(layers[j], option);
    case ActivationChoice::kSwap: {
      const double copy =
          static_cast<double>(MadeBytes(layers[j], option)) / problem.link_bytes_per_us;
      const bool last = j + 1 == layers.size();
      const double down_hidden = last ? 0 : layers[j + 1].forward_us;
      const double up_hidden = last ? 0 : layers[j + 1].backward_us;
      const double taken =
          2 * static_cast<double>(MadeBytes(layers[j], option)) * problem.copy_compute_us_per_byte;
      return RebuildTime(layers[j], option) + std::max(0.0, copy - down_hidden) +
             std::max(0.0, copy - up_hidden) + taken;
    }
  }
  return 0;
}

// The larger of the device bytes while F_j and while B_j run, given the bytes kept before j,
// layer j's option and what layer j-1's swap still holds (see the header).
int64_t PeakAt(const ActivationProblem& problem, size_t j, int64_t kept_before,
               const Option& option, int64_t previous_in_flight) {
  const ActivationLayer& layer = problem.layers[j];
  const int64_t local = RunningBytes(problem, layer, option) +
                        (layer.kept_copies - 1) * KeptBytes(layer, option) + previous_in_flight +
                        kept_before;
  return local + std::max(Base(problem.base_forward_bytes, j),
                          Base(problem.base_backward_bytes, j) + RecomputeBytes(layer, option));
}

// A state of the programme after some layers: the bytes kept so far, what the latest layer's
// swap still holds while the next forward runs, the time added so far, and how it was reached.
struct State {
  int64_t kept = 0;
  int64_t in_flight = 0;
  double extra_us = 0;
  Option last;      // the latest layer's option
  int parent = -1;  // index in the previous layer's states
};

// Keeps, among the states holding the same bytes in flight, those no other beats on both kept
// bytes and time (what follows depends on nothing else).
std::vector<State> Pareto(std::vector<State> states) {
  std::sort(states.begin(), states.end(), [](const State& a, const State& b) {
    if (a.in_flight != b.in_flight) return a.in_flight < b.in_flight;
    if (a.kept != b.kept) return a.kept < b.kept;
    return a.extra_us < b.extra_us;
  });
  std::vector<State> front;
  for (size_t i = 0; i < states.size(); ++i) {
    const bool new_group = i == 0 || states[i].in_flight != states[i - 1].in_flight;
    if (new_group || states[i].extra_us < front.back().extra_us) {
      if (!new_group && states[i].kept == front.back().kept) continue;
      front.push_back(states[i]);
    }
  }
  return front;
}

// "keep 5, keep part 1, recompute 6, swap 0"
std::string ChoiceCounts(const ActivationPlan& plan) {
  return fmt::format("keep {}, keep part {}, recompute {}, swap {}",
                     plan.Count(ActivationChoice::kKeep), plan.Count(ActivationChoice::kKeepPart),
                     plan.Count(ActivationChoice::kRecompute), plan.Count(ActivationChoice::kSwap));
}

ActivationDecision DecisionOf(const ActivationLayer& layer, const Option& option) {
  ActivationDecision decision{option.choice, ""};
  if (option.part >= 0) {
    decision.rebuild = layer.partial_keeps[static_cast<size_t>(option.part)].rebuild;
  }
  return decision;
}

}  // namespace

ActivationPlan EvaluateActivationPlan(const ActivationProblem& problem,
                                      std::vector<ActivationDecision> decisions) {
  ActivationPlan plan;
  const size_t n = problem.layers.size();
  std::vector<Option> options;
  options.reserve(n);
  double step = 0;
  for (size_t j = 0; j < n; ++j) {
    options.push_back(OptionOf(problem.layers[j], decisions[j]));
    step += problem.layers[j].forward_us + problem.layers[j].backward_us +
            ExtraTime(problem, j, options[j]);
  }
  // The live bytes, position by position, from each layer's interval (not the programme's
  // recurrence, so that the two check each other).
  int64_t peak = 0;
  for (size_t j = 0; j < n; ++j) {
    for (const bool backward : {false, true}) {
      int64_t live = Base(backward ? problem.base_backward_bytes : problem.base_forward_bytes, j);
      for (size_t i = 0; i < n; ++i) {
        const ActivationLayer& layer = problem.layers[i];
        if (i == j) {
          live += RunningBytes(problem, layer, options[i]) +
                  (backward ? RecomputeBytes(layer, options[i]) : 0) +
                  (layer.kept_copies - 1) * KeptBytes(layer, options[i]);
        } else if (i < j) {
          live += layer.kept_copies * KeptBytes(layer, options[i]);
          if (i + 1 == j) live += InFlightBytes(layer, options[i]);
        }
      }
      peak = std::max(peak, live);
    }
  }
  plan.decisions = std::move(decisions);
  plan.step_us = step;
  plan.peak_bytes = peak;
  plan.fits = peak <= problem.cap_bytes;
  return plan;
}

Result<ActivationPlan> SolveActivations(const ActivationProblem& problem) {
  TESSERA_RETURN_IF_ERROR(problem.Validate());
  const size_t n = problem.layers.size();
  // states[j]: the states after deciding layers 0 .. j-1.
  std::vector<std::vector<State>> states(n + 1);
  states[0].push_back(State{});
  for (size_t j = 0; j < n; ++j) {
    const std::vector<Option> options = OptionsOf(problem, j);
    std::vector<State> next;
    for (size_t s = 0; s < states[j].size(); ++s) {
      const State& state = states[j][s];
      for (const Option& option : options) {
        if (PeakAt(problem, j, state.kept, option, state.in_flight) > problem.cap_bytes) continue;
        State grown;
        grown.kept =
            state.kept + problem.layers[j].kept_copies * KeptBytes(problem.layers[j], option);
        grown.in_flight = InFlightBytes(problem.layers[j], option);
        grown.extra_us = state.extra_us + ExtraTime(problem, j, option);
        grown.last = option;
        grown.parent = static_cast<int>(s);
        next.push_back(grown);
      }
    }
    states[j + 1] = Pareto(std::move(next));
    if (states[j + 1].empty()) break;
  }
  if (states[n].empty()) {
    // The least the allowed choices can hold: per layer, the option keeping the fewest bytes
    // (then making the fewest).
    std::vector<ActivationDecision> least(n);
    for (size_t j = 0; j < n; ++j) {
      const std::vector<Option> options = OptionsOf(problem, j);
      const Option* fewest = &options[0];
      for (const Option& option : options) {
        const ActivationLayer& layer = problem.layers[j];
        if (std::pair(KeptBytes(layer, option), MadeBytes(layer, option)) <
            std::pair(KeptBytes(layer, *fewest), MadeBytes(layer, *fewest))) {
          fewest = &option;
        }
      }
      least[j] = DecisionOf(problem.layers[j], *fewest);
    }
    const ActivationPlan smallest = EvaluateActivationPlan(problem, std::move(least));
    return Infeasible(
        "the activations cannot fit under the device cap of {} bytes: the least they can hold "
        "({}) peaks at {} bytes; raise the cap by {} bytes, or make each layer's saved "
        "activations smaller (more micro-batches, shorter sequences) or its other memory "
        "(ZeRO-3, more workers)",
        problem.cap_bytes, ChoiceCounts(smallest), smallest.peak_bytes,
        smallest.peak_bytes - problem.cap_bytes);
  }
  const std::vector<State>& last = states[n];
  size_t best = 0;
  for (size_t s = 1; s < last.size(); ++s) {
    if (last[s].extra_us < last[best].extra_us) best = s;
  }
  std::vector<ActivationDecision> decisions(n);
  int index = static_cast<int>(best);
  for (size_t j = n; j > 0; --j) {
    const State& state = states[j][static_cast<size_t>(index)];
    decisions[j - 1] = DecisionOf(problem.layers[j - 1], state.last);
    index = state.parent;
  }
  return EvaluateActivationPlan(problem, std::move(decisions));
}

std::string DescribeActivationPlan(const ActivationPlan& plan,
                                   const std::vector<std::string>& layer_names) {
  std::string text = ChoiceCounts(plan) + ":";
  for (size_t i = 0; i < plan.decisions.size(); ++i) {
    const ActivationDecision& decision = plan.decisions[i];
    const std::string name = i < layer_names.size() ? layer_names[i] : fmt::format("{}", i);
    text += fmt::format("{} {} {}", i == 0 ? "" : ",", name, ActivationChoiceName(decision.choice));
    if (!decision.rebuild.empty()) text += fmt::format(" ({})", decision.rebuild);
  }
  return text;
}

}  // namespace tessera
