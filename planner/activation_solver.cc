#include "planner/activation_solver.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace tessera {

const char* ActivationChoiceName(ActivationChoice choice) {
  switch (choice) {
    case ActivationChoice::kKeep:
      return "keep";
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
  return Status::Ok();
}

int ActivationPlan::Count(ActivationChoice choice) const {
  return static_cast<int>(std::count(choices.begin(), choices.end(), choice));
}

namespace {

constexpr size_t kChoices = 3;
constexpr std::array<ActivationChoice, kChoices> kAll = {
    ActivationChoice::kKeep, ActivationChoice::kRecompute, ActivationChoice::kSwap};

int64_t Base(const std::vector<int64_t>& base, size_t j) { return base.empty() ? 0 : base[j]; }

bool Allowed(const ActivationProblem& problem, ActivationChoice choice) {
  switch (choice) {
    case ActivationChoice::kKeep:
      return true;
    case ActivationChoice::kRecompute:
      return problem.allow_recompute;
    case ActivationChoice::kSwap:
      return problem.allow_swap && problem.link_bytes_per_us > 0;
  }
  return false;
}

// The time layer j's choice adds to the forwards and backwards.
double ExtraTime(const ActivationProblem& problem, size_t j, ActivationChoice choice) {
  const std::vector<ActivationLayer>& layers = problem.layers;
  switch (choice) {
    case ActivationChoice::kKeep:
      return 0;
    case ActivationChoice::kRecompute:
      return layers[j].forward_us;
    case ActivationChoice::kSwap: {
      const double copy = static_cast<double>(layers[j].saved_bytes) / problem.link_bytes_per_us;
      const bool last = j + 1 == layers.size();
      const double down_hidden = last ? 0 : layers[j + 1].forward_us;
      const double up_hidden = last ? 0 : layers[j + 1].backward_us;
      return std::max(0.0, copy - down_hidden) + std::max(0.0, copy - up_hidden);
    }
  }
  return 0;
}

// The larger of the device bytes while F_j and while B_j run, given the bytes kept before j and
// whether layer j-1 swaps (see the header).
int64_t PeakAt(const ActivationProblem& problem, size_t j, int64_t kept_before,
               bool previous_swaps) {
  const int64_t local = problem.layers[j].saved_bytes +
                        (previous_swaps ? problem.layers[j - 1].saved_bytes : 0) + kept_before;
  return local +
         std::max(Base(problem.base_forward_bytes, j), Base(problem.base_backward_bytes, j));
}

// A state of the programme after some layers: the bytes kept so far, the time added so far,
// and how it was reached.
struct State {
  int64_t kept = 0;
  double extra_us = 0;
  ActivationChoice last = ActivationChoice::kKeep;  // the choice of the latest layer
  int parent = -1;                                  // index in the previous layer's states
};

// Keeps, per latest choice, the states no other beats on both kept bytes and time.
std::vector<State> Pareto(std::vector<State> states) {
  std::sort(states.begin(), states.end(), [](const State& a, const State& b) {
    if (a.last != b.last) return a.last < b.last;
    if (a.kept != b.kept) return a.kept < b.kept;
    return a.extra_us < b.extra_us;
  });
  std::vector<State> front;
  for (size_t i = 0; i < states.size(); ++i) {
    const bool new_group = i == 0 || states[i].last != states[i - 1].last;
    if (new_group || states[i].extra_us < front.back().extra_us) {
      if (!new_group && states[i].kept == front.back().kept) continue;
      front.push_back(states[i]);
    }
  }
  return front;
}

}  // namespace

ActivationPlan EvaluateActivationPlan(const ActivationProblem& problem,
                                      std::vector<ActivationChoice> choices) {
  ActivationPlan plan;
  const size_t n = problem.layers.size();
  double step = 0;
  for (size_t j = 0; j < n; ++j) {
    step += problem.layers[j].forward_us + problem.layers[j].backward_us +
            ExtraTime(problem, j, choices[j]);
  }
  // The live bytes, position by position, from each layer's interval (not the programme's
  // recurrence, so that the two check each other).
  int64_t peak = 0;
  for (size_t j = 0; j < n; ++j) {
    for (const bool backward : {false, true}) {
      int64_t live = Base(backward ? problem.base_backward_bytes : problem.base_forward_bytes, j);
      for (size_t i = 0; i < n; ++i) {
        const int64_t s = problem.layers[i].saved_bytes;
        if (i == j) {
          live += s;
        } else if (i < j) {
          if (choices[i] == ActivationChoice::kKeep) live += s;
          if (choices[i] == ActivationChoice::kSwap && i + 1 == j) live += s;
        }
      }
      peak = std::max(peak, live);
    }
  }
  plan.choices = std::move(choices);
  plan.step_us = step;
  plan.peak_bytes = peak;
  plan.fits = peak <= problem.cap_bytes;
  return plan;
}

Result<ActivationPlan> SolveActivations(const ActivationProblem& problem) {
  TESSERA_RETURN_IF_ERROR(problem.Validate());
  const size_t n = problem.layers.size();
  // layers_states[j]: the states after deciding layers 0 .. j-1.
  std::vector<std::vector<State>> states(n + 1);
  states[0].push_back(State{});
  for (size_t j = 0; j < n; ++j) {
    std::vector<State> next;
    for (size_t s = 0; s < states[j].size(); ++s) {
      const State& state = states[j][s];
      const bool previous_swaps = j > 0 && state.last == ActivationChoice::kSwap;
      if (PeakAt(problem, j, state.kept, previous_swaps) > problem.cap_bytes) continue;
      for (ActivationChoice choice : kAll) {
        if (!Allowed(problem, choice)) continue;
        if (problem.layers[j].must_keep && choice != ActivationChoice::kKeep) continue;
        State grown;
        grown.kept =
            state.kept + (choice == ActivationChoice::kKeep ? problem.layers[j].saved_bytes : 0);
        grown.extra_us = state.extra_us + ExtraTime(problem, j, choice);
        grown.last = choice;
        grown.parent = static_cast<int>(s);
        next.push_back(grown);
      }
    }
    states[j + 1] = Pareto(std::move(next));
    if (states[j + 1].empty()) break;
  }
  if (states[n].empty()) {
    // The least the allowed choices can hold: nothing kept or swapped where that is allowed.
    const ActivationChoice least = problem.allow_recompute ? ActivationChoice::kRecompute
                                   : Allowed(problem, ActivationChoice::kSwap)
                                       ? ActivationChoice::kSwap
                                       : ActivationChoice::kKeep;
    std::vector<ActivationChoice> least_choices(n, least);
    for (size_t j = 0; j < n; ++j) {
      if (problem.layers[j].must_keep) least_choices[j] = ActivationChoice::kKeep;
    }
    const ActivationPlan smallest = EvaluateActivationPlan(problem, std::move(least_choices));
    return Infeasible(
        "the activations cannot fit under the device cap of {} bytes: the least they can hold "
        "({} every layer) peaks at {} bytes; raise the cap by {} bytes, or make each layer's "
        "saved activations smaller (more micro-batches, shorter sequences) or its other memory "
        "(ZeRO-3, more workers)",
        problem.cap_bytes, ActivationChoiceName(least), smallest.peak_bytes,
        smallest.peak_bytes - problem.cap_bytes);
  }
  const std::vector<State>& last = states[n];
  size_t best = 0;
  for (size_t s = 1; s < last.size(); ++s) {
    if (last[s].extra_us < last[best].extra_us) best = s;
  }
  std::vector<ActivationChoice> choices(n);
  int index = static_cast<int>(best);
  for (size_t j = n; j > 0; --j) {
    const State& state = states[j][static_cast<size_t>(index)];
    choices[j - 1] = state.last;
    index = state.parent;
  }
  return EvaluateActivationPlan(problem, std::move(choices));
}

std::string DescribeActivationPlan(const ActivationPlan& plan,
                                   const std::vector<std::string>& layer_names) {
  std::string text =
      fmt::format("keep {}, recompute {}, swap {}:", plan.Count(ActivationChoice::kKeep),
                  plan.Count(ActivationChoice::kRecompute), plan.Count(ActivationChoice::kSwap));
  for (size_t i = 0; i < plan.choices.size(); ++i) {
    const std::string name = i < layer_names.size() ? layer_names[i] : fmt::format("{}", i);
    text += fmt::format("{} {} {}", i == 0 ? "" : ",", name, ActivationChoiceName(plan.choices[i]));
  }
  return text;
}

}  // namespace tessera
