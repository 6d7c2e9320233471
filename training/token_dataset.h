// Token datasets and batch sampling for language-model training.
//
// Sources:
//   - a text file, tokenized as bytes (vocab 256): what ships in data/ for the main job;
//   - a .bin token file in the llm.c format: a header of 256 int32 (magic 20240520, version 1,
//     token count) followed by that many uint16 tokens;
//   - nanoGPT's .bin (what its prepare.py writes): raw little-endian uint16 tokens, no header,
//     read only when asked for (DataFormat::kUint16: nothing in such a file says what it is);
//   - synthetic tokens (uniform random), for benchmarks.
// Errors name the file and what is wrong with it (missing, not a regular file, empty, bad magic,
// neither tokens nor text, truncated, larger than memory).
//
// BatchSampler draws batches of B windows of T+1 consecutive tokens (inputs and next-token
// targets) at random offsets from a seeded generator: the same seed gives the same batches.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace tessera {

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;
inline constexpr int kTokenFileHeaderInts = 256;

// How a data file is read: by its content (Load's rules), or as the user says.
enum class DataFormat : uint8_t { kAuto, kText, kLlmc, kUint16 };
// "auto", "text", "llmc", "uint16"; InvalidArgument naming the choices otherwise.
Result<DataFormat> ParseDataFormat(std::string_view text);
const char* DataFormatName(DataFormat format);

class TokenDataset {
 public:
  // By content: a file starting with the .bin magic is read as tokens; anything else only if it
  // is plausibly text (no NUL byte and at most 1% control bytes in its first 64 KiB), so a token
  // file with a wrong magic or another binary file is refused (InvalidArgument naming what it
  // starts with, and that a headerless nanoGPT file needs DataFormat::kUint16) instead of trained
  // on as bytes. A path that is not a regular file (a directory, /dev/zero) is InvalidArgument; a
  // file whose tokens would not fit in the machine's memory is ResourceExhausted.
  static Result<TokenDataset> Load(const std::string& path);
  // As `format` says (kAuto: Load).
  static Result<TokenDataset> Load(const std::string& path, DataFormat format);
  // Raw little-endian uint16 tokens, no header (nanoGPT's train.bin); DataLoss for an odd byte
  // count, InvalidArgument for an empty file.
  static Result<TokenDataset> LoadRawUint16(const std::string& path);
  static Result<TokenDataset> LoadText(const std::string& path);
  static Result<TokenDataset> LoadTokenFile(const std::string& path);
  static TokenDataset Synthetic(int64_t num_tokens, int32_t vocab, uint64_t seed);

  // Writes tokens in the .bin format (atomically: temp file, fsync, rename).
  static Status WriteTokenFile(const std::string& path, const std::vector<uint16_t>& tokens);

  const std::vector<int32_t>& tokens() const { return tokens_; }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  int32_t max_token() const { return max_token_; }
  const std::string& source() const { return source_; }
  bool is_text() const { return is_text_; }

  // The first (1 - fraction) and the last `fraction` of the tokens.
  // REQUIRES: 0 <= fraction < 1.
  std::pair<TokenDataset, TokenDataset> Split(double fraction) const;

 private:
  TokenDataset(std::vector<int32_t> tokens, std::string source, bool is_text);
  static Result<TokenDataset> FromTextBytes(const std::string& bytes, const std::string& path);
  static Result<TokenDataset> FromTokenFileBytes(const std::string& bytes, const std::string& path);
  static Result<TokenDataset> FromUint16Bytes(const char* data, int64_t count,
                                              const std::string& path);
  std::vector<int32_t> tokens_;
  int32_t max_token_ = -1;
  std::string source_;
  bool is_text_ = false;
};

class BatchSampler {
 public:
  // InvalidArgument when the dataset has fewer than seq_len + 1 tokens.
  static Result<BatchSampler> Create(const TokenDataset& dataset, int64_t batch, int64_t seq_len,
                                     uint64_t seed);
  // Fills inputs and targets, each [batch * seq_len], row-major.
  void Next(int32_t* inputs, int32_t* targets);
  // The i-th batch of a fixed, sequential pass (for evaluation): window b starts at
  // ((i * batch + b) * seq_len) modulo the usable length.
  void Sequential(int64_t index, int32_t* inputs, int32_t* targets) const;
  // The sampler's position (its random generator's state) as text, and back: a resumed run
  // draws the batches the interrupted one would have. InvalidArgument for text that is not
  // such a state.
  std::string SaveState() const;
  Status RestoreState(const std::string& state);

 private:
  BatchSampler(const TokenDataset& dataset, int64_t batch, int64_t seq_len, uint64_t seed)
      : dataset_(&dataset), batch_(batch), seq_len_(seq_len), rng_(seed) {}
  void FillWindow(int64_t start, int32_t* inputs, int32_t* targets) const;

  const TokenDataset* dataset_;
  int64_t batch_, seq_len_;
  std::mt19937_64 rng_;
};

}  // namespace tessera
