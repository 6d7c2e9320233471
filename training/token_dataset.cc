#include "training/token_dataset.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/allocator.h"
#include "core/atomic_file.h"

namespace tessera {

TokenDataset::TokenDataset(std::vector<int32_t> tokens, std::string source, bool is_text)
    : tokens_(std::move(tokens)), source_(std::move(source)), is_text_(is_text) {
  for (int32_t token : tokens_) max_token_ = std::max(max_token_, token);
}

namespace {

// llm.c's GPT-2 checkpoints (model/gpt2_llmc.h), a file a user may pass as data by mistake.
constexpr int32_t kLlmcCheckpointMagic = 20240326;
// How much of a file LooksLikeText reads.
constexpr size_t kTextSniffBytes = size_t{64} << 10;

// Plausibly text: in the first kTextSniffBytes, no NUL byte and at most 1% control bytes
// (below 0x20 except tab, newline, carriage return, form feed, vertical tab; and DEL). Bytes from
// 0x80 up pass, so UTF-8 and Latin-1 text are both text. Binary files (token files with another
// magic, checkpoints, images, compressed data) have NUL bytes or many control bytes early.
bool LooksLikeText(std::string_view bytes) {
  bytes = bytes.substr(0, kTextSniffBytes);
  size_t control = 0;
  for (char c : bytes) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte == 0) return false;
    if ((byte < 0x20 && std::strchr("\t\n\r\f\v", byte) == nullptr) || byte == 0x7f) ++control;
  }
  return control * 100 <= bytes.size();
}

// The tokens of a file of `count` tokens, as 32-bit ids, must fit in the machine's memory.
Status CheckTokensFit(const std::string& path, int64_t count) {
  const int64_t memory = PhysicalHostMemoryBytes();
  const int64_t bytes = count * static_cast<int64_t>(sizeof(int32_t));
  if (memory <= 0 || bytes <= memory) return Status::Ok();
  return ResourceExhausted(
      "data file '{}' holds {} tokens, {:.1f} GiB as 32-bit token ids: more than this machine's "
      "{:.1f} GiB of memory; train on a part of it",
      path, count, static_cast<double>(bytes) / (1 << 30), static_cast<double>(memory) / (1 << 30));
}

}  // namespace

Result<TokenDataset> TokenDataset::Load(const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path, "data file"));
  int32_t magic = 0;
  if (bytes.size() >= sizeof(magic)) std::memcpy(&magic, bytes.data(), sizeof(magic));
  if (magic == kTokenFileMagic) return FromTokenFileBytes(bytes, path);
  if (magic == kLlmcCheckpointMagic) {
    return InvalidArgument(
        "data file '{}' is an llm.c GPT-2 checkpoint (magic {}), not training data: start from "
        "it with --init-from, and give --data a text file or an llm.c .bin token file",
        path, magic);
  }
  if (!LooksLikeText(bytes)) {
    return InvalidArgument(
        "data file '{}' is neither an llm.c token file (it starts with {}, not the magic {}) nor "
        "text (it has NUL or control bytes in its first {} KiB): give a text file, tokenized as "
        "bytes, or a .bin token file of llm.c's format; for nanoGPT's .bin (raw uint16 tokens, "
        "no header) pass --data-format uint16",
        path, magic, kTokenFileMagic, kTextSniffBytes / 1024);
  }
  return FromTextBytes(bytes, path);
}

Result<DataFormat> ParseDataFormat(std::string_view text) {
  for (const DataFormat format :
       {DataFormat::kAuto, DataFormat::kText, DataFormat::kLlmc, DataFormat::kUint16}) {
    if (text == DataFormatName(format)) return format;
  }
  return InvalidArgument(
      "data format '{}' is not one of auto (by content), text (bytes), llmc (llm.c's .bin with "
      "its header) or uint16 (raw tokens, no header: nanoGPT's .bin)",
      text);
}

const char* DataFormatName(DataFormat format) {
  switch (format) {
    case DataFormat::kAuto:
      return "auto";
    case DataFormat::kText:
      return "text";
    case DataFormat::kLlmc:
      return "llmc";
    case DataFormat::kUint16:
      return "uint16";
  }
  return "?";
}

Result<TokenDataset> TokenDataset::Load(const std::string& path, DataFormat format) {
  switch (format) {
    case DataFormat::kAuto:
      return Load(path);
    case DataFormat::kText:
      return LoadText(path);
    case DataFormat::kLlmc:
      return LoadTokenFile(path);
    case DataFormat::kUint16:
      return LoadRawUint16(path);
  }
  return InvalidArgument("data format {} is unknown", static_cast<int>(format));
}

Result<TokenDataset> TokenDataset::LoadRawUint16(const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path, "data file"));
  if (bytes.empty()) return InvalidArgument("data file '{}' is empty", path);
  if (bytes.size() % sizeof(uint16_t) != 0) {
    return DataLoss(
        "data file '{}' is {} bytes, an odd count, so not raw uint16 tokens (--data-format "
        "uint16): truncated, or another format",
        path, bytes.size());
  }
  return FromUint16Bytes(bytes.data(), static_cast<int64_t>(bytes.size() / sizeof(uint16_t)), path);
}

Result<TokenDataset> TokenDataset::FromUint16Bytes(const char* data, int64_t count,
                                                   const std::string& path) {
  TESSERA_RETURN_IF_ERROR(CheckTokensFit(path, count));
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    uint16_t token;
    std::memcpy(&token, data + i * static_cast<int64_t>(sizeof(uint16_t)), sizeof(token));
    tokens[static_cast<size_t>(i)] = token;
  }
  return TokenDataset(std::move(tokens), path, /*is_text=*/false);
}

Result<TokenDataset> TokenDataset::LoadText(const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path, "data file"));
  return FromTextBytes(bytes, path);
}

Result<TokenDataset> TokenDataset::LoadTokenFile(const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path, "data file"));
  return FromTokenFileBytes(bytes, path);
}

Result<TokenDataset> TokenDataset::FromTextBytes(const std::string& bytes,
                                                 const std::string& path) {
  if (bytes.empty()) return InvalidArgument("data file '{}' is empty", path);
  TESSERA_RETURN_IF_ERROR(CheckTokensFit(path, static_cast<int64_t>(bytes.size())));
  std::vector<int32_t> tokens(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) tokens[i] = static_cast<unsigned char>(bytes[i]);
  return TokenDataset(std::move(tokens), path, /*is_text=*/true);
}

Result<TokenDataset> TokenDataset::FromTokenFileBytes(const std::string& bytes,
                                                      const std::string& path) {
  constexpr size_t kHeaderBytes = kTokenFileHeaderInts * sizeof(int32_t);
  if (bytes.size() < kHeaderBytes) {
    return DataLoss("token file '{}' is {} bytes, shorter than its {}-byte header (truncated?)",
                    path, bytes.size(), kHeaderBytes);
  }
  int32_t header[kTokenFileHeaderInts];
  std::memcpy(header, bytes.data(), kHeaderBytes);
  if (header[0] != kTokenFileMagic) {
    return InvalidArgument(
        "token file '{}' has magic {} but {} was expected (is it a llm.c .bin token file?)", path,
        header[0], kTokenFileMagic);
  }
  if (header[1] != kTokenFileVersion) {
    return InvalidArgument("token file '{}' has version {}; only version {} is supported", path,
                           header[1], kTokenFileVersion);
  }
  const int64_t count = header[2];
  const size_t expected = kHeaderBytes + static_cast<size_t>(count) * sizeof(uint16_t);
  if (count <= 0 || bytes.size() != expected) {
    return DataLoss(
        "token file '{}' declares {} tokens ({} bytes) but has {} bytes (truncated or corrupt)",
        path, count, expected, bytes.size());
  }
  return FromUint16Bytes(bytes.data() + kHeaderBytes, count, path);
}

TokenDataset TokenDataset::Synthetic(int64_t num_tokens, int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> tokens(static_cast<size_t>(num_tokens));
  for (int32_t& token : tokens) token = dist(rng);
  return TokenDataset(std::move(tokens), "synthetic", /*is_text=*/false);
}

Status TokenDataset::WriteTokenFile(const std::string& path, const std::vector<uint16_t>& tokens) {
  int32_t header[kTokenFileHeaderInts] = {};
  header[0] = kTokenFileMagic;
  header[1] = kTokenFileVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(uint16_t));
  return WriteFileAtomically(path, bytes);
}

std::pair<TokenDataset, TokenDataset> TokenDataset::Split(double fraction) const {
  TESSERA_CHECK(fraction >= 0 && fraction < 1, "split fraction {}", fraction);
  const auto cut = static_cast<size_t>(static_cast<double>(tokens_.size()) * (1.0 - fraction));
  std::vector<int32_t> first(tokens_.begin(), tokens_.begin() + static_cast<ptrdiff_t>(cut));
  std::vector<int32_t> second(tokens_.begin() + static_cast<ptrdiff_t>(cut), tokens_.end());
  return {TokenDataset(std::move(first), source_ + " (train split)", is_text_),
          TokenDataset(std::move(second), source_ + " (validation split)", is_text_)};
}

Result<BatchSampler> BatchSampler::Create(const TokenDataset& dataset, int64_t batch,
                                          int64_t seq_len, uint64_t seed) {
  if (batch <= 0 || seq_len <= 0) {
    return InvalidArgument("batch ({}) and seq_len ({}) must be positive", batch, seq_len);
  }
  if (dataset.size() < seq_len + 1) {
    return InvalidArgument("{} has {} tokens, fewer than seq_len + 1 = {}", dataset.source(),
                           dataset.size(), seq_len + 1);
  }
  return BatchSampler(dataset, batch, seq_len, seed);
}

void BatchSampler::FillWindow(int64_t start, int32_t* inputs, int32_t* targets) const {
  const int32_t* tokens = dataset_->tokens().data() + start;
  std::copy(tokens, tokens + seq_len_, inputs);
  std::copy(tokens + 1, tokens + seq_len_ + 1, targets);
}

void BatchSampler::Next(int32_t* inputs, int32_t* targets) {
  std::uniform_int_distribution<int64_t> offset(0, dataset_->size() - seq_len_ - 1);
  for (int64_t b = 0; b < batch_; ++b) {
    FillWindow(offset(rng_), inputs + b * seq_len_, targets + b * seq_len_);
  }
}

std::string BatchSampler::SaveState() const {
  std::ostringstream out;
  out << rng_;
  return out.str();
}

Status BatchSampler::RestoreState(const std::string& state) {
  std::istringstream in(state);
  std::mt19937_64 restored;
  in >> restored;
  if (in.fail())
    return InvalidArgument("'{}...' is not a batch sampler state", state.substr(0, 20));
  rng_ = restored;
  return Status::Ok();
}

void BatchSampler::Sequential(int64_t index, int32_t* inputs, int32_t* targets) const {
  const int64_t usable = dataset_->size() - seq_len_;  // >= 1
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t start = ((index * batch_ + b) * seq_len_) % usable;
    FillWindow(start, inputs + b * seq_len_, targets + b * seq_len_);
  }
}

}  // namespace tessera
