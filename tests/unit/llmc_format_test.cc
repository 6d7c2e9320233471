// llm.c's fp32 GPT-2 checkpoint format (model/gpt2_llmc.h: ExportLlmc, ImportLlmc,
// ReadLlmcConfig), here on a trainer's parameter groups: the file is laid out as llm.c reads it,
// an export imports back bit-exactly, and a damaged file is refused naming the file and what is
// wrong.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gpt2_test_util.h"
#include "model/gpt2.h"
#include "model/gpt2_llmc.h"
#include "test_util.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

// A vocabulary that is not a multiple of 128, so wte is padded in the file (300 -> 384 rows).
Gpt2Config SmallConfig() {
  return Gpt2Config{.layers = 2, .channels = 32, .heads = 2, .vocab = 300, .max_seq_len = 16};
}

Result<std::unique_ptr<Trainer>> InProcessTrainer(const Gpt2Config& config) {
  TrainingPlan plan;
  plan.batch = 2;
  plan.seq_len = config.max_seq_len;
  TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildGpt2(config));
  return Trainer::Create(std::move(model), plan, ExecutorOptions{.threads = 1});
}

Status Export(Trainer& trainer, const Gpt2Config& config, const std::string& path) {
  return tessera::ExportLlmc(config, Gpt2Groups(trainer), path);
}
Status Import(Trainer& trainer, const Gpt2Config& config, const std::string& path) {
  return tessera::ImportLlmc(config, Gpt2Groups(trainer), path);
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(LlmcFormatTest, ExportIsLaidOutAsLlmcReadsIt) {
  const Gpt2Config config = SmallConfig();
  ASSERT_OK_AND_ASSIGN(auto trainer, InProcessTrainer(config));
  ASSERT_OK(trainer->InitializeParameters(5));
  const std::string path = TempPath("llmc_layout.bin");
  ASSERT_OK(Export(*trainer, config, path));
  const std::string bytes = ReadFileText(path);
  const int64_t padded_vocab = 384;
  ASSERT_EQ(bytes.size(),
            1024 + 4 * static_cast<size_t>(config.NumParameters() +
                                           (padded_vocab - config.vocab) * config.channels));
  int32_t header[256];
  std::memcpy(header, bytes.data(), sizeof(header));
  EXPECT_EQ(header[0], 20240326);
  EXPECT_EQ(header[1], 3);
  EXPECT_EQ(header[2], config.max_seq_len);
  EXPECT_EQ(header[3], config.vocab);
  EXPECT_EQ(header[4], config.layers);
  EXPECT_EQ(header[5], config.heads);
  EXPECT_EQ(header[6], config.channels);
  EXPECT_EQ(header[7], padded_vocab);
  for (int i = 8; i < 256; ++i) EXPECT_EQ(header[i], 0) << i;
  // wte first, its padding rows zero, then wpe; lnf_b last.
  const auto floats_at = [&](size_t offset, size_t count) {
    std::vector<float> values(count);
    std::memcpy(values.data(), bytes.data() + offset, count * sizeof(float));
    return values;
  };
  const size_t wte = static_cast<size_t>(config.vocab * config.channels);
  const size_t padding = static_cast<size_t>((padded_vocab - config.vocab) * config.channels);
  EXPECT_EQ(floats_at(1024, wte), *trainer->GetParameter("wte"));
  EXPECT_EQ(floats_at(1024 + 4 * wte, padding), std::vector<float>(padding, 0.0f));
  EXPECT_EQ(floats_at(1024 + 4 * (wte + padding), config.max_seq_len * config.channels),
            *trainer->GetParameter("wpe"));
  const size_t channels = static_cast<size_t>(config.channels);
  EXPECT_EQ(floats_at(bytes.size() - 4 * channels, channels), *trainer->GetParameter("lnf_b"));
  ASSERT_OK_AND_ASSIGN(Gpt2Config read, ReadLlmcConfig(path));
  EXPECT_EQ(read.ToString(), config.ToString());
}

TEST(LlmcFormatTest, ExportImportRoundTripsBitExactly) {
  const Gpt2Config config = SmallConfig();
  ASSERT_OK_AND_ASSIGN(auto source, InProcessTrainer(config));
  ASSERT_OK(source->InitializeParameters(7));
  const std::string path = TempPath("llmc_round_trip.bin");
  ASSERT_OK(Export(*source, config, path));
  ASSERT_OK_AND_ASSIGN(auto target, InProcessTrainer(config));
  ASSERT_OK(target->InitializeParameters(8));  // other values, which the import replaces
  ASSERT_OK(Import(*target, config, path));
  for (const std::string& name : source->ParameterNames()) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> expected, source->GetParameter(name));
    ASSERT_OK_AND_ASSIGN(std::vector<float> actual, target->GetParameter(name));
    ASSERT_EQ(actual.size(), expected.size()) << name;
    EXPECT_EQ(std::memcmp(actual.data(), expected.data(), expected.size() * sizeof(float)), 0)
        << name;
  }
  // And out again: the same bytes.
  const std::string again = TempPath("llmc_round_trip_again.bin");
  ASSERT_OK(Export(*target, config, again));
  EXPECT_EQ(ReadFileText(again), ReadFileText(path));
}

TEST(LlmcFormatTest, DamagedFilesAreRefusedNamingTheFileAndTheFault) {
  const Gpt2Config config = SmallConfig();
  ASSERT_OK_AND_ASSIGN(auto trainer, InProcessTrainer(config));
  ASSERT_OK(trainer->InitializeParameters(9));
  const std::string good = TempPath("llmc_good.bin");
  ASSERT_OK(Export(*trainer, config, good));
  const std::string bytes = ReadFileText(good);
  const auto expect_error = [&](const std::string& path, StatusCode code, const std::string& what) {
    Result<Gpt2Config> read = ReadLlmcConfig(path);
    ASSERT_FALSE(read.ok()) << path;
    EXPECT_EQ(read.status().code(), code) << read.status().ToString();
    EXPECT_NE(read.status().message().find(path), std::string::npos) << read.status().ToString();
    EXPECT_NE(read.status().message().find(what), std::string::npos) << read.status().ToString();
    // ImportLlmc refuses the same file the same way, and leaves the parameters as they were.
    const std::vector<float> before = *trainer->GetParameter("wte");
    Status imported = Import(*trainer, config, path);
    EXPECT_EQ(imported.code(), code) << imported.ToString();
    EXPECT_NE(imported.message().find(what), std::string::npos) << imported.ToString();
    EXPECT_EQ(*trainer->GetParameter("wte"), before);
  };

  const std::string truncated = TempPath("llmc_truncated.bin");
  WriteBytes(truncated, bytes.substr(0, bytes.size() - 4));
  expect_error(truncated, StatusCode::kDataLoss, "is truncated");
  const std::string header_only = TempPath("llmc_header_cut.bin");
  WriteBytes(header_only, bytes.substr(0, 100));
  expect_error(header_only, StatusCode::kDataLoss, "too short for an llm.c checkpoint");
  const std::string longer = TempPath("llmc_longer.bin");
  WriteBytes(longer, bytes + "junk");
  expect_error(longer, StatusCode::kDataLoss, "4 bytes after the last tensor");

  std::string wrong_magic = bytes;
  const int32_t token_magic = 20240520;
  std::memcpy(wrong_magic.data(), &token_magic, sizeof(token_magic));
  const std::string bad_magic = TempPath("llmc_bad_magic.bin");
  WriteBytes(bad_magic, wrong_magic);
  expect_error(bad_magic, StatusCode::kInvalidArgument, "magic number is 20240326");

  std::string bf16 = bytes;
  const int32_t version = 5;
  std::memcpy(bf16.data() + 4, &version, sizeof(version));
  const std::string bf16_path = TempPath("llmc_bf16.bin");
  WriteBytes(bf16_path, bf16);
  expect_error(bf16_path, StatusCode::kInvalidArgument, "only version 3 (fp32 weights)");

  std::string damaged = bytes;
  const int32_t layers = -1;
  std::memcpy(damaged.data() + 16, &layers, sizeof(layers));
  const std::string damaged_path = TempPath("llmc_damaged.bin");
  WriteBytes(damaged_path, damaged);
  expect_error(damaged_path, StatusCode::kDataLoss, "damaged llm.c header");

  Result<Gpt2Config> missing = ReadLlmcConfig(TempPath("llmc_missing.bin"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
}

TEST(LlmcFormatTest, AnotherModelIsRefusedNamingBoth) {
  ASSERT_OK_AND_ASSIGN(auto source, InProcessTrainer(SmallConfig()));
  ASSERT_OK(source->InitializeParameters(1));
  const std::string path = TempPath("llmc_other_model.bin");
  ASSERT_OK(Export(*source, SmallConfig(), path));
  Gpt2Config other = SmallConfig();
  other.layers = 3;
  ASSERT_OK_AND_ASSIGN(auto target, InProcessTrainer(other));
  Status imported = Import(*target, other, path);
  EXPECT_EQ(imported.code(), StatusCode::kInvalidArgument) << imported.ToString();
  EXPECT_NE(imported.message().find(SmallConfig().ToString()), std::string::npos)
      << imported.ToString();
  EXPECT_NE(imported.message().find(other.ToString()), std::string::npos) << imported.ToString();
}

}  // namespace
}  // namespace tessera::testing
