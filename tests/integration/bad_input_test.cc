// Bad input to the real programs, as a table: each case runs the binary (train_gpt2, the
// `tessera` CLI) with one thing wrong and expects what a user needs back — a message naming what
// is wrong (a substring of it), a non-zero exit, no signal (no abort on an uncaught exception, no
// bad_alloc), and an end within a few seconds (no hang: a case still running at the deadline is
// killed and fails). The deadline is generous because the machine may be loaded; no case is
// timed more tightly than that.
#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace tessera::testing {
namespace {

constexpr std::chrono::seconds kDeadline(20);

struct BadInput {
  const char* name;         // what the case is, for failure messages
  std::string binary;       // in build/bin
  std::string arguments;    // a shell command line
  std::string environment;  // "NAME=value ..." added to the environment
  std::string expected;     // a substring of the output
};

void ExpectRefused(const BadInput& input) {
  SCOPED_TRACE(std::string(input.name) + ": " + input.environment + " " + input.binary + " " +
               input.arguments);
  const BoundedRun run =
      RunBinaryWithin(input.binary, input.arguments, kDeadline, input.environment);
  EXPECT_FALSE(run.timed_out) << "still running after " << kDeadline.count() << " s\n"
                              << run.output;
  EXPECT_EQ(run.signal, 0) << "ended by signal " << run.signal << "\n" << run.output;
  EXPECT_TRUE(run.exited) << run.output;
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find(input.expected), std::string::npos)
      << "expected \"" << input.expected << "\" in:\n"
      << run.output;
}

// A file of `ints` int32 values, the first `magic`.
std::string BinaryFile(const std::string& name, int32_t magic, size_t ints) {
  std::string path = TempPath(name);
  std::vector<int32_t> values(ints, 0);
  values[0] = magic;
  values[1] = 1;
  values[2] = static_cast<int32_t>(ints);
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(values.data()),
             static_cast<std::streamsize>(values.size() * sizeof(int32_t)));
  return path;
}

TEST(BadInputTest, TrainGpt2RefusesBadDataFiles) {
  const std::string directory = TempPath("data_dir");
  std::filesystem::create_directories(directory);
  const std::string wrong_magic = BinaryFile("wrong_magic.bin", 20240521, 4096);
  const std::string checkpoint = BinaryFile("checkpoint_as_data.bin", 20240326, 4096);
  const std::string fifo = TempPath("data.fifo");
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const BadInput& input : std::vector<BadInput>{
           {"a directory", "train_gpt2", "--steps 1 --data " + directory, "", "is a directory"},
           {"an endless device", "train_gpt2", "--steps 1 --data /dev/zero", "",
            "'/dev/zero' is a device, pipe or socket, not a regular file"},
           {"a pipe", "train_gpt2", "--steps 1 --data " + fifo, "", "not a regular file"},
           {"a token file with a wrong magic", "train_gpt2", "--steps 1 --data " + wrong_magic, "",
            "is neither an llm.c token file (it starts with 20240521"},
           {"a checkpoint given as data", "train_gpt2", "--steps 1 --data " + checkpoint, "",
            "is an llm.c GPT-2 checkpoint"},
           {"a directory as the checkpoint", "train_gpt2", "--steps 1 --init-from " + directory, "",
            "is not a regular file but a directory"},
       }) {
    ExpectRefused(input);
  }
}

TEST(BadInputTest, TrainGpt2RefusesSizesMemoryCannotHold) {
  for (const BadInput& input : std::vector<BadInput>{
           // The batch's token ids alone are more than the machine's memory.
           {"an absurd batch", "train_gpt2", "--steps 1 --batch 100000000", "",
            "lower the batch (--batch)"},
           {"an absurd synthetic batch", "train_gpt2",
            "--steps 1 --data synthetic --batch 100000000", "", "lower the batch (--batch)"},
           // The token ids fit; the step's logits (2M x 64 x 256 floats, 131 GB) do not.
           {"a step larger than memory", "train_gpt2", "--steps 1 --batch 2000000", "",
            "a step needs at least"},
           {"an absurd depth", "train_gpt2", "--steps 1 --layers 100000 --channels 8 --heads 1", "",
            "--layers must be from 1 to 1024, got 100000"},
       }) {
    ExpectRefused(input);
  }
}

TEST(BadInputTest, TrainGpt2RefusesBadFlagValuesSayingWhatTheyMustBe) {
  const std::string checkpoints = TempPath("bad_input_checkpoints");
  for (const BadInput& input : std::vector<BadInput>{
           {"a zero batch", "train_gpt2", "--batch 0", "", "--batch must be at least 1, got 0"},
           {"a zero learning rate", "train_gpt2", "--lr 0", "", "--lr must be above 0, got 0"},
           {"negative threads", "train_gpt2", "--threads=-2", "",
            "--threads must be at least 0, got -2"},
           {"more minimum workers than workers", "train_gpt2",
            "--steps 1 --workers 2 --min-workers 3 --max-restarts 1 --checkpoint-dir " +
                checkpoints,
            "", "--min-workers 3 is more than --workers 2"},
           {"a bucket size that is not one", "train_gpt2", "--steps 1 --bucket-mb lots", "",
            "--bucket-mb 'lots' is neither auto nor a size in MB"},
           {"a negative bucket size", "train_gpt2", "--steps 1 --bucket-mb=-2", "",
            "--bucket-mb '-2' is neither auto nor a size in MB"},
       }) {
    ExpectRefused(input);
  }
}

TEST(BadInputTest, SettingsOutOfRangeAreRefusedAtStartUp) {
  for (const BadInput& input : std::vector<BadInput>{
           {"a zero data-plane chunk", "train_gpt2", "--steps 1 --workers 1",
            "TESSERA_DATA_CHUNK_BYTES=0", "TESSERA_DATA_CHUNK_BYTES=0 is out of range"},
           {"negative threads", "train_gpt2", "--steps 1", "TESSERA_CPU_THREADS=-1",
            "TESSERA_CPU_THREADS=-1 is out of range"},
           {"a negative grace", "train_gpt2", "--steps 1 --workers 1",
            "TESSERA_SCHEDULER_GRACE_MS=-5", "TESSERA_SCHEDULER_GRACE_MS=-5 is out of range"},
           {"a timeout below the heartbeat", "train_gpt2", "--steps 1",
            "TESSERA_HEARTBEAT_TIMEOUT_MS=200", "must be above TESSERA_HEARTBEAT_INTERVAL_MS"},
       }) {
    ExpectRefused(input);
  }
}

TEST(BadInputTest, TesseraCliRefusesBadFlagValuesSayingWhatTheyMustBe) {
  for (const BadInput& input : std::vector<BadInput>{
           {"a port out of range", "tessera", "start --head --port 99999", "",
            "--port must be from 0 to 65535, got 99999"},
           {"a dashboard port out of range", "tessera", "start --head --dashboard-port 70000", "",
            "--dashboard-port must be from -1 to 65535, got 70000"},
           {"no workers", "tessera", "start --address 127.0.0.1:1 --cpu-workers 0", "",
            "--cpu-workers must be at least 1, got 0"},
       }) {
    ExpectRefused(input);
  }
}

}  // namespace
}  // namespace tessera::testing
