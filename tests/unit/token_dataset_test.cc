// Token datasets: text, llm.c .bin files, nanoGPT's headerless ones, and what is wrong with a
// bad file.
#include <fstream>

#include "test_util.h"
#include "training/token_dataset.h"

namespace tessera::testing {
namespace {

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(TokenDatasetTest, TextIsTokenizedAsBytes) {
  const std::string path = TempPath("text.txt");
  WriteBytes(path, "Hi!\n\xff");
  ASSERT_OK_AND_ASSIGN(TokenDataset data, TokenDataset::Load(path));
  EXPECT_TRUE(data.is_text());
  EXPECT_EQ(data.tokens(), (std::vector<int32_t>{'H', 'i', '!', '\n', 255}));
  EXPECT_EQ(data.max_token(), 255);
}

TEST(TokenDatasetTest, TokenFilesRoundTripThroughTheLlmcFormat) {
  const std::string path = TempPath("tokens.bin");
  const std::vector<uint16_t> tokens = {50256, 1, 2, 3, 65535};
  ASSERT_OK(TokenDataset::WriteTokenFile(path, tokens));
  ASSERT_OK_AND_ASSIGN(TokenDataset data, TokenDataset::Load(path));
  EXPECT_FALSE(data.is_text());
  EXPECT_EQ(data.tokens(), (std::vector<int32_t>{50256, 1, 2, 3, 65535}));
}

TEST(TokenDatasetTest, BadFilesSayWhichFileAndWhy) {
  Result<TokenDataset> missing = TokenDataset::Load(TempPath("does_not_exist.bin"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("does_not_exist.bin"), std::string::npos);

  const std::string empty = TempPath("empty.txt");
  WriteBytes(empty, "");
  EXPECT_NE(TokenDataset::Load(empty).status().message().find("is empty"), std::string::npos);

  const std::string not_tokens = TempPath("not_tokens.bin");
  WriteBytes(not_tokens, std::string(2048, 'x'));
  Result<TokenDataset> bad_magic = TokenDataset::LoadTokenFile(not_tokens);
  ASSERT_FALSE(bad_magic.ok());
  EXPECT_NE(bad_magic.status().message().find("magic"), std::string::npos);

  const std::string truncated = TempPath("truncated.bin");
  ASSERT_OK(TokenDataset::WriteTokenFile(truncated, std::vector<uint16_t>(100, 7)));
  std::ifstream in(truncated, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  WriteBytes(truncated, bytes.substr(0, bytes.size() - 11));
  Result<TokenDataset> short_file = TokenDataset::Load(truncated);
  ASSERT_FALSE(short_file.ok());
  EXPECT_EQ(short_file.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(short_file.status().message().find("truncated"), std::string::npos);
  EXPECT_NE(short_file.status().message().find("declares 100 tokens"), std::string::npos);

  const std::string header_only = TempPath("header_only.bin");
  WriteBytes(header_only, bytes.substr(0, 100));
  ASSERT_FALSE(TokenDataset::LoadTokenFile(header_only).ok());
}

// Load reads what is not a token file as text only when it plausibly is text: a token file with
// another magic, an llm.c checkpoint or other binary data is refused saying what it is; paths that
// are not regular files are refused before anything is read.
TEST(TokenDatasetTest, OnlyTextIsReadAsText) {
  const std::string utf8 = TempPath("utf8.txt");
  WriteBytes(utf8, "caf\xc3\xa9\tna\xc3\xafve\r\n\f");
  ASSERT_OK_AND_ASSIGN(TokenDataset text, TokenDataset::Load(utf8));
  EXPECT_TRUE(text.is_text());

  std::string wrong_magic(1024, '\0');
  wrong_magic[0] = 1;
  const std::string wrong = TempPath("wrong_magic.bin");
  WriteBytes(wrong, wrong_magic);
  Result<TokenDataset> binary = TokenDataset::Load(wrong);
  ASSERT_FALSE(binary.ok());
  EXPECT_EQ(binary.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(binary.status().message().find("neither an llm.c token file (it starts with 1,"),
            std::string::npos)
      << binary.status().ToString();

  std::string controls(1000, 'a');
  for (size_t i = 0; i < 20; ++i) controls[i * 50] = '\x01';  // 2% control bytes, no NUL
  const std::string noisy = TempPath("controls.bin");
  WriteBytes(noisy, controls);
  EXPECT_FALSE(TokenDataset::Load(noisy).ok());

  const std::string checkpoint = TempPath("checkpoint.bin");
  const int32_t header[4] = {20240326, 3, 1024, 50257};
  WriteBytes(checkpoint, std::string(reinterpret_cast<const char*>(header), sizeof(header)));
  Result<TokenDataset> model = TokenDataset::Load(checkpoint);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("--init-from"), std::string::npos)
      << model.status().ToString();

  for (const std::string& path : {::testing::TempDir(), std::string("/dev/zero")}) {
    Result<TokenDataset> special = TokenDataset::Load(path);
    ASSERT_FALSE(special.ok()) << path;
    EXPECT_EQ(special.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(special.status().message().find("not a regular file"), std::string::npos)
        << special.status().ToString();
  }
}

// nanoGPT's .bin (raw little-endian uint16 tokens, no header): refused by content, with the flag
// that reads it named; read exactly as asked; an odd byte count refused as not uint16 tokens.
// The formats parse by name, and a format forced on a file reads it that way.
TEST(TokenDatasetTest, NanoGptsHeaderlessTokensAreReadWhenAskedFor) {
  const std::string path = TempPath("nanogpt_train.bin");
  const std::vector<uint16_t> tokens = {50256, 0, 464, 2068, 7586, 65535};
  WriteBytes(path, std::string(reinterpret_cast<const char*>(tokens.data()),
                               tokens.size() * sizeof(uint16_t)));
  Result<TokenDataset> guessed = TokenDataset::Load(path);
  ASSERT_FALSE(guessed.ok());
  EXPECT_NE(guessed.status().message().find("--data-format uint16"), std::string::npos)
      << guessed.status().ToString();
  ASSERT_OK_AND_ASSIGN(TokenDataset raw, TokenDataset::Load(path, DataFormat::kUint16));
  EXPECT_FALSE(raw.is_text());
  EXPECT_EQ(raw.tokens(), (std::vector<int32_t>{50256, 0, 464, 2068, 7586, 65535}));
  EXPECT_EQ(raw.max_token(), 65535);

  const std::string odd = TempPath("odd.bin");
  WriteBytes(odd, std::string("\x01\x02\x03", 3));
  Result<TokenDataset> odd_bytes = TokenDataset::LoadRawUint16(odd);
  EXPECT_EQ(odd_bytes.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(odd_bytes.status().message().find("3 bytes, an odd count"), std::string::npos)
      << odd_bytes.status().ToString();
  const std::string empty = TempPath("empty_raw.bin");
  WriteBytes(empty, "");
  EXPECT_NE(TokenDataset::LoadRawUint16(empty).status().message().find("is empty"),
            std::string::npos);

  for (const DataFormat format :
       {DataFormat::kAuto, DataFormat::kText, DataFormat::kLlmc, DataFormat::kUint16}) {
    ASSERT_OK_AND_ASSIGN(DataFormat parsed, ParseDataFormat(DataFormatName(format)));
    EXPECT_EQ(parsed, format);
  }
  EXPECT_NE(ParseDataFormat("nanogpt").status().message().find("uint16 (raw tokens"),
            std::string::npos);
  // Forced: the same bytes as text are one token a byte; as llm.c's format, refused for its
  // missing header.
  ASSERT_OK_AND_ASSIGN(TokenDataset bytes, TokenDataset::Load(path, DataFormat::kText));
  EXPECT_EQ(bytes.size(), static_cast<int64_t>(tokens.size() * sizeof(uint16_t)));
  EXPECT_FALSE(TokenDataset::Load(path, DataFormat::kLlmc).ok());
}

TEST(TokenDatasetTest, SplitKeepsOrderAndProportions) {
  TokenDataset data = TokenDataset::Synthetic(1000, 50, 1);
  auto [train, val] = data.Split(0.1);
  EXPECT_EQ(train.size(), 900);
  EXPECT_EQ(val.size(), 100);
  EXPECT_EQ(val.tokens().front(), data.tokens()[900]);
}

TEST(BatchSamplerTest, TargetsAreInputsShiftedByOneAndSeedsRepeat) {
  std::vector<int32_t> ramp(100);
  for (int i = 0; i < 100; ++i) ramp[i] = i;
  const std::string path = TempPath("ramp.bin");
  ASSERT_OK(TokenDataset::WriteTokenFile(path, std::vector<uint16_t>(ramp.begin(), ramp.end())));
  ASSERT_OK_AND_ASSIGN(TokenDataset data, TokenDataset::Load(path));
  ASSERT_OK_AND_ASSIGN(BatchSampler a, BatchSampler::Create(data, 3, 8, 7));
  ASSERT_OK_AND_ASSIGN(BatchSampler b, BatchSampler::Create(data, 3, 8, 7));
  std::vector<int32_t> in_a(24), tgt_a(24), in_b(24), tgt_b(24);
  a.Next(in_a.data(), tgt_a.data());
  b.Next(in_b.data(), tgt_b.data());
  EXPECT_EQ(in_a, in_b);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(tgt_a[i], in_a[i] + 1);
  a.Sequential(0, in_a.data(), tgt_a.data());
  EXPECT_EQ(in_a[0], 0);
  EXPECT_EQ(in_a[8], 8);

  Result<BatchSampler> too_short = BatchSampler::Create(data, 1, 100, 1);
  ASSERT_FALSE(too_short.ok());
  EXPECT_NE(too_short.status().message().find("fewer than seq_len + 1"), std::string::npos);
}

}  // namespace
}  // namespace tessera::testing
