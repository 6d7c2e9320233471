// A GPT-2's trainer as tests drive it: steps, evaluation and logits on token windows (their
// input tensors built with model/gpt2.h's Gpt2Batch / Gpt2Prompt for the trainer's plan, the ids
// checked against its vocabulary first), and its parameter groups as model/gpt2_llmc.h's llm.c
// functions take them.
//
// Stateless functions; as thread-safe as the trainer (not at all).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "model/gpt2.h"
#include "model/gpt2_llmc.h"
#include "training/trainer.h"

namespace tessera::testing {

// One step on tokens and targets of the plan's [batch, seq_len].
inline Result<StepReport> Gpt2Step(Trainer& trainer, std::span<const int32_t> tokens,
                                   std::span<const int32_t> targets, float lr) {
  TESSERA_ASSIGN_OR_RETURN(Gpt2Config config, Gpt2ConfigOf(trainer.model()));
  TESSERA_ASSIGN_OR_RETURN(
      std::vector<Tensor> batch,
      Gpt2Batch(config, tokens, targets, trainer.plan().batch, trainer.plan().seq_len));
  return trainer.Step(batch, lr);
}

// The mean loss of tokens and targets of the plan's [batch, seq_len].
inline Result<float> Gpt2EvalLoss(Trainer& trainer, std::span<const int32_t> tokens,
                                  std::span<const int32_t> targets) {
  TESSERA_ASSIGN_OR_RETURN(Gpt2Config config, Gpt2ConfigOf(trainer.model()));
  TESSERA_ASSIGN_OR_RETURN(
      std::vector<Tensor> batch,
      Gpt2Batch(config, tokens, targets, trainer.plan().batch, trainer.plan().seq_len));
  return trainer.EvalLoss(batch);
}

// Logits [batch, seq_len, vocab] of tokens of any [batch, seq_len], flattened.
inline Result<std::vector<float>> Gpt2Logits(Trainer& trainer, std::span<const int32_t> tokens,
                                             int64_t batch, int64_t seq_len) {
  TESSERA_ASSIGN_OR_RETURN(Gpt2Config config, Gpt2ConfigOf(trainer.model()));
  TESSERA_ASSIGN_OR_RETURN(std::vector<Tensor> prompt, Gpt2Prompt(config, tokens, batch, seq_len));
  TESSERA_ASSIGN_OR_RETURN(Tensor logits, trainer.Predict(prompt));
  const float* data = logits.data<float>();
  return std::vector<float>(data, data + logits.numel());
}

// The trainer's parameter groups for ExportLlmc / ImportLlmc (re-padded as its plan pads them).
inline Gpt2ParameterGroups Gpt2Groups(Trainer& trainer) {
  return {
      .read = [&trainer](size_t layer) { return trainer.ReadGroup(layer, StateKind::kParameter); },
      .write =
          [&trainer](size_t layer, std::span<const float> values) {
            std::vector<float> group(static_cast<size_t>(trainer.step_graph().group_numel[layer]),
                                     0.0f);
            std::copy(values.begin(), values.end(), group.begin());
            return trainer.WriteGroup(layer, StateKind::kParameter, group);
          }};
}

}  // namespace tessera::testing
