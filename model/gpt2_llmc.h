// llm.c's GPT-2 checkpoint format: the full fp32 weights of a GPT-2 (gpt2_124M.bin), so llm.c
// loads what ExportLlmc writes and a run can start from llm.c's (or an earlier run's) weights.
//
//   a 256-int32 header [20240326, 3, max_seq_len, vocab, layers, heads, channels, padded_vocab,
//   0...], then the tensors in llm.c's order (wte, wpe, then each of ln1_w ... fcproj_b for every
//   block in turn, lnf_w, lnf_b), raw little-endian fp32; wte's vocabulary rows are padded with
//   zeros to padded_vocab, a multiple of 128.
//
// The functions need only the model description (model/gpt2.h: the layouts of BuildGpt2's
// groups, from the Gpt2Config) and a way to read and write whole parameter groups, which the
// caller gives as callbacks (a trainer's ReadGroup / WriteGroup): nothing here knows where the
// groups live. Optimizer state and the step count are not part of the format.
//
// Stateless functions; thread-safe as the callbacks are.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/gpt2.h"

namespace tessera {

// A GPT-2's parameter groups, by layer index in BuildGpt2's order (embedding, h.0 ... h.{L-1},
// head).
struct Gpt2ParameterGroups {
  // The whole group of a layer: its parameters first, in the layout of BuildGpt2's layer, then
  // whatever padding the holder keeps (ignored). Needed by ExportLlmc.
  std::function<Result<std::vector<float>>(size_t layer)> read;
  // Sets the parameters of a layer to `values` (exactly the layout's elements; the holder pads
  // as it needs). Needed by ImportLlmc.
  std::function<Status(size_t layer, std::span<const float> values)> write;
};

// The model an llm.c checkpoint holds, from its header; the file's size is checked against it,
// so a file that reads here imports into a model of that config. NotFound when `path` cannot be
// opened; InvalidArgument when it is not an fp32 llm.c GPT-2 checkpoint (magic, version);
// DataLoss when it is truncated, too long, or its header is damaged. Each names the file.
Result<Gpt2Config> ReadLlmcConfig(const std::string& path);

// Writes the parameters of the GPT-2 `config` describes, read through groups.read, to `path`
// atomically (core/atomic_file.h). The errors of groups.read; InvalidArgument when a group is
// smaller than its layout.
Status ExportLlmc(const Gpt2Config& config, const Gpt2ParameterGroups& groups,
                  const std::string& path);
// Sets the parameters of the GPT-2 `config` describes from `path`, through groups.write. The
// errors of ReadLlmcConfig, and InvalidArgument when the file holds another model than
// `config` (naming both). The whole file is read and checked before the first write, so a bad
// file changes nothing.
Status ImportLlmc(const Gpt2Config& config, const Gpt2ParameterGroups& groups,
                  const std::string& path);

}  // namespace tessera
