// train_gpt2 as a user runs it: a real process, its output and exit status.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "core/atomic_file.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

ProcessResult RunTrainGpt2(const std::string& arguments) {
  return RunBinary("train_gpt2", arguments);
}

// Each (arguments, message): a one-step run with them exits 1 saying the message.
void ExpectRefused(const std::vector<std::pair<std::string, std::string>>& refused) {
  for (const auto& [arguments, message] : refused) {
    ProcessResult run = RunTrainGpt2("--steps 1 --batch 8 " + arguments);
    EXPECT_EQ(run.exit_code, 1) << arguments << "\n" << run.output;
    EXPECT_NE(run.output.find(message), std::string::npos) << arguments << "\n" << run.output;
  }
}

double FirstMatch(const std::string& text, const std::string& pattern) {
  std::smatch match;
  if (!std::regex_search(text, match, std::regex(pattern))) return -1;
  return std::stod(match[1]);
}

TEST(TrainGpt2Test, TinyPresetOnTheBundledTextLearnsAndSamples) {
  ProcessResult run = RunTrainGpt2("--preset tiny --steps 200 --sample 120 --threads 2");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const double first =
      FirstMatch(run.output, R"(step 1/200 loss ([0-9.]+)  [0-9.]+ ms  [0-9]+ tok/s)");
  const double final_loss = FirstMatch(
      run.output,
      R"(summary: steps=200 step_ms_median=[0-9.]+ tokens_per_s=[0-9]+ final_loss=([0-9.]+) peak_mb=[0-9.]+)");
  ASSERT_GT(first, 0) << run.output;
  ASSERT_GT(final_loss, 0) << run.output;
  // Byte-level text starts near ln(256) = 5.5; 200 steps must get well below that.
  EXPECT_GT(first, 5.0);
  EXPECT_LT(final_loss, 0.6 * first) << run.output;
  const size_t sample = run.output.find("sample:\n");
  ASSERT_NE(sample, std::string::npos) << run.output;
  const size_t summary = run.output.find("summary:", sample);
  EXPECT_GE(summary - sample, 120u) << "the sample should print 120 tokens of text";
}

TEST(TrainGpt2Test, EvalEveryReportsValidationLoss) {
  ProcessResult run = RunTrainGpt2("--steps 20 --eval-every 10 --eval-batches 2 --log-every 10");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_GT(FirstMatch(run.output, R"(eval step 10: val_loss ([0-9.]+))"), 0) << run.output;
  EXPECT_GT(FirstMatch(run.output, R"(eval step 20: val_loss ([0-9.]+))"), 0) << run.output;
}

// --explain-memory predicts the step's memory before it runs; on one executor thread the
// measured peak of the step's objects with the running kernel's scratch (the rank line after
// training) is exactly that.
TEST(TrainGpt2Test, ExplainMemoryPredictsTheMeasuredPeak) {
  ProcessResult run = RunTrainGpt2("--preset tiny --steps 2 --threads 1 --explain-memory");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const double predicted = FirstMatch(run.output, R"(host tier: peak ([0-9.]+) MiB while )");
  const double measured =
      FirstMatch(run.output, R"(worker rank 0: .*with kernel scratch ([0-9.]+) MB)");
  ASSERT_GT(predicted, 0) << run.output;
  EXPECT_EQ(predicted, measured) << run.output;
  EXPECT_NE(run.output.find("live at the peak by role: "), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("kernel scratch"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("timeline (live while the task runs)"), std::string::npos)
      << run.output;
  // With no steps it only explains.
  ProcessResult only = RunTrainGpt2("--preset tiny --steps 0 --explain-memory");
  ASSERT_EQ(only.exit_code, 0) << only.output;
  EXPECT_NE(only.output.find("host tier: peak"), std::string::npos) << only.output;
}

// Under an activation budget the planner's recomputes are tasks like any other: in the trace of
// every rank, every step.
TEST(TrainGpt2Test, RecomputesChosenUnderAnActivationBudgetAreInTheTrace) {
  const std::string trace = ::testing::TempDir() + "/recompute_trace.json";
  ProcessResult run = RunTrainGpt2(
      "--preset tiny --layers 4 --steps 2 --workers 2 "
      "--activation-budget 0.5 --explain-memory --trace " +
      trace);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("memory plan (host tier): "), std::string::npos) << run.output;
  ASSERT_OK_AND_ASSIGN(std::string json, ReadWholeFile(trace));
  for (const char* rank : {"rank0", "rank1"}) {
    const std::string name = fmt::format("\"name\":\"{}/h.0/recompute\"", rank);
    size_t spans = 0;
    for (size_t at = json.find(name); at != std::string::npos; at = json.find(name, at + 1)) {
      ++spans;
    }
    EXPECT_EQ(spans, 2u) << rank << " (one per step)";
  }
}

// On a GPU (the simulated one here) under an activation budget, --balance profile also measures
// the host link, and the planner swaps saved activations to the host where the copies hide
// under compute; a link given by flag is not measured.
TEST(TrainGpt2Test, OnAGpuTheProfileMeasuresTheHostLinkAndThePlanSwaps) {
  ::setenv("TESSERA_SIMULATED_GPU", "1", 1);
  ProcessResult measured = RunTrainGpt2(
      "--device cuda --layers 4 --steps 2 --batch 8 --balance profile --activation-budget 0.5 "
      "--explain-memory");
  ProcessResult given = RunTrainGpt2(
      "--device cuda --layers 4 --steps 1 --batch 8 --balance profile --activation-budget 0.5 "
      "--host-link-gbps 0.001 --explain-memory");
  ::unsetenv("TESSERA_SIMULATED_GPU");
  ASSERT_EQ(measured.exit_code, 0) << measured.output;
  EXPECT_GT(FirstMatch(measured.output, R"(host link \(measured, cuda:0\): ([0-9.]+) GB/s)"), 0)
      << measured.output;
  EXPECT_NE(measured.output.find("memory plan (device tier): "), std::string::npos)
      << measured.output;
  EXPECT_GT(FirstMatch(measured.output, R"(swap ([0-9]+):)"), 0) << measured.output;
  // A link of 1 MB/s hides nothing: no swaps, and nothing measured.
  ASSERT_EQ(given.exit_code, 0) << given.output;
  EXPECT_EQ(given.output.find("host link (measured"), std::string::npos) << given.output;
  EXPECT_EQ(FirstMatch(given.output, R"(swap ([0-9]+):)"), 0) << given.output;
}

// On CPU workers under an activation budget, --swap-dir gives the disk tier: --balance profile
// measures the swap file's link (and the compute time its copies take), the plan swaps saved
// activations to the disk, --explain-memory shows the disk tier's peak, and the run trains the
// unbudgeted run's losses exactly (swaps move bytes, they change none), in this process and on a
// local cluster's worker (which makes its own swap file from TESSERA_SWAP_DIR). A swap directory
// that is not there is named.
TEST(TrainGpt2Test, OnCpuWorkersTheSwapDirGivesADiskTierActivationsSwapTo) {
  const std::string dir = TempPath("train_gpt2_swap");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string model = "--layers 4 --threads 1 --batch 8";
  const std::string run = model + " --steps 3 --log-every 3";
  const std::string swapping = run +
                               " --balance profile --activation-budget 0.5 --disk-link-gbps 1000 "
                               "--explain-memory --swap-dir " +
                               dir;
  ProcessResult plain = RunTrainGpt2(run);
  ProcessResult here = RunTrainGpt2(swapping);
  ProcessResult worker = RunTrainGpt2(swapping + " --workers 1");
  ProcessResult measured = RunTrainGpt2(
      model + " --steps 1 --balance profile --activation-budget 0.5 --swap-dir " + dir);
  ProcessResult missing = RunTrainGpt2(run + " --swap-dir " + dir + "/missing");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const double expected = FirstMatch(plain.output, R"(final_loss=([0-9.]+))");
  ASSERT_GT(expected, 0) << plain.output;
  for (const ProcessResult* swapped : {&here, &worker}) {
    ASSERT_EQ(swapped->exit_code, 0) << swapped->output;
    EXPECT_GT(FirstMatch(swapped->output, R"(swap ([0-9]+):)"), 0) << swapped->output;
    EXPECT_EQ(FirstMatch(swapped->output, R"(final_loss=([0-9.]+))"), expected) << swapped->output;
  }
  EXPECT_NE(here.output.find("disk tier: peak"), std::string::npos) << here.output;
  ASSERT_EQ(measured.exit_code, 0) << measured.output;
  EXPECT_GT(FirstMatch(measured.output, R"(disk link \(measured, swap file in .*: ([0-9.]+) GB/s)"),
            0)
      << measured.output;
  // And the compute time its copies take, which the plan prices every swap by (a figure of this
  // machine: at least 0).
  EXPECT_GE(FirstMatch(measured.output, R"(a MiB copied takes ([0-9.]+) us of the compute)"), 0)
      << measured.output;
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("--swap-dir"), std::string::npos) << missing.output;
  EXPECT_NE(missing.output.find("missing"), std::string::npos) << missing.output;
  EXPECT_TRUE(std::filesystem::is_empty(dir));  // the swap files were unlinked
}

// On a GPU (the simulated one) whose --device-memory-gib is below the model state (3.37 MB of
// fp32 parameters, gradients and Adam moments here), the plan streams the parameters from the
// host on its own (some layers' at least: the largest that fit stay) and says so, --explain-memory
// says what moves between the tiers, and the losses are those of --offload parameters asked for.
TEST(TrainGpt2Test, OnAGpuAStateBeyondTheDeviceCapIsStreamedFromTheHost) {
  ::setenv("TESSERA_SIMULATED_GPU", "1", 1);
  ProcessResult capped = RunTrainGpt2(
      "--device cuda --layers 4 --steps 2 --batch 8 --device-memory-gib 0.003 --explain-memory");
  ProcessResult asked = RunTrainGpt2(
      "--device cuda --layers 4 --steps 2 --batch 8 --offload "
      "parameters");
  ::unsetenv("TESSERA_SIMULATED_GPU");
  ASSERT_EQ(capped.exit_code, 0) << capped.output;
  EXPECT_GE(FirstMatch(capped.output, R"(the parameters of ([0-9]+) of 6 layers streamed from )"),
            1)
      << capped.output;
  EXPECT_GT(FirstMatch(capped.output, R"(copied between tiers: ([0-9.]+) MiB a step)"), 0)
      << capped.output;
  const double gpu_peak_mb = FirstMatch(capped.output, R"(gpu_peak_mb=([0-9.]+))");
  EXPECT_GT(gpu_peak_mb, 0) << capped.output;
  EXPECT_LE(gpu_peak_mb, 0.003 * 1024 + 0.05) << capped.output;  // printed to 0.1 MiB
  ASSERT_EQ(asked.exit_code, 0) << asked.output;
  EXPECT_EQ(FirstMatch(asked.output, R"(final_loss=([0-9.]+))"),
            FirstMatch(capped.output, R"(final_loss=([0-9.]+))"));
}

// A checkpoint of a run whose parameters live on the host (--offload parameters, on the
// simulated GPU) holds the same groups as any other: resumed on the plain plan (state on the
// device), the run ends where an uninterrupted plain run does.
TEST(TrainGpt2Test, OnAGpuAParameterOffloadCheckpointResumesOnThePlainPlan) {
  const std::string dir = TempPath("train_gpt2_offload_checkpoints");
  std::filesystem::remove_all(dir);
  const std::string run = "--device cuda --layers 4 --batch 8 --threads 1 --log-every 4 ";
  ::setenv("TESSERA_SIMULATED_GPU", "1", 1);
  ProcessResult whole = RunTrainGpt2(run + "--steps 8");
  ProcessResult first =
      RunTrainGpt2(run + "--steps 4 --offload parameters --checkpoint-dir " + dir);
  ProcessResult second = RunTrainGpt2(run + "--steps 8 --resume --checkpoint-dir " + dir);
  ::unsetenv("TESSERA_SIMULATED_GPU");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  const double whole_loss = FirstMatch(whole.output, R"(final_loss=([0-9.]+))");
  EXPECT_GT(whole_loss, 0) << whole.output;
  EXPECT_NEAR(FirstMatch(second.output, R"(final_loss=([0-9.]+))"), whole_loss, 1e-5 * whole_loss)
      << second.output;
}

TEST(TrainGpt2Test, HelpListsEveryFlag) {
  ProcessResult run = RunTrainGpt2("--help");
  EXPECT_EQ(run.exit_code, 0);
  for (const char* flag : {"--layers",
                           "--channels",
                           "--heads",
                           "--vocab",
                           "--seq-len",
                           "--batch",
                           "--preset",
                           "--steps",
                           "--lr",
                           "--seed",
                           "--threads",
                           "--data",
                           "--eval-every",
                           "--sample",
                           "--workers",
                           "--zero-stage",
                           "--offload",
                           "--grad-accum",
                           "--checkpoint-dir",
                           "--checkpoint-every",
                           "--resume",
                           "--pipeline-stages",
                           "--stage-layers",
                           "--micro-batches",
                           "--schedule",
                           "--virtual-stages",
                           "--balance",
                           "--bucket-mb",
                           "--explain-memory",
                           "--activation-budget",
                           "--host-memory-gib",
                           "--device-memory-gib",
                           "--host-link-gbps",
                           "--layer-impl",
                           "--plan",
                           "--recalibrate",
                           "--show-plans"}) {
    EXPECT_NE(run.output.find(flag), std::string::npos) << flag;
  }
}

// Help starts with the usage line and shows the defaults; the environment's settings come last.
// A mistyped flag is answered with the one it was likely meant to be.
TEST(TrainGpt2Test, HelpStartsWithUsageAndAMistypedFlagGetsAGuess) {
  ProcessResult help = RunTrainGpt2("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_EQ(help.output.rfind("Usage:", 0), 0u) << help.output.substr(0, 300);
  EXPECT_NE(help.output.find("--steps INT:>=0=200"), std::string::npos) << help.output;
  EXPECT_GT(help.output.find("TESSERA_CPU_THREADS="), help.output.find("--steps")) << help.output;
  ProcessResult typo = RunTrainGpt2("--step 3");
  EXPECT_EQ(typo.exit_code, 2) << typo.output;
  EXPECT_NE(typo.output.find("(did you mean --steps?)"), std::string::npos) << typo.output;
}

TEST(TrainGpt2Test, VersionNamesTheBuild) {
  ProcessResult run = RunTrainGpt2("--version");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("train_gpt2: Tessera 0."), std::string::npos) << run.output;
}

TEST(TrainGpt2Test, NonsenseFlagsPrintUsage) {
  for (const char* arguments :
       {"--bogus", "--steps many", "--preset huge", "--batch -3", "--balance guess"}) {
    ProcessResult run = RunTrainGpt2(arguments);
    EXPECT_EQ(run.exit_code, 2) << arguments << "\n" << run.output;
    EXPECT_NE(run.output.find("Usage"), std::string::npos) << arguments << "\n" << run.output;
  }
}

TEST(TrainGpt2Test, BadModelAndDataAreExplained) {
  ProcessResult heads = RunTrainGpt2("--channels 64 --heads 5 --steps 1");
  EXPECT_EQ(heads.exit_code, 1);
  EXPECT_NE(heads.output.find("divisible by heads"), std::string::npos) << heads.output;

  ProcessResult missing = RunTrainGpt2("--data /nonexistent/tokens.bin --steps 1");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("/nonexistent/tokens.bin"), std::string::npos) << missing.output;

  // A .bin file whose header promises more tokens than it holds.
  const std::string truncated = TempPath("truncated_tokens.bin");
  {
    std::ofstream out(truncated, std::ios::binary);
    int32_t header[256] = {20240520, 1, 1000};
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    out.write("\x01\x00\x02\x00", 4);
  }
  ProcessResult short_file = RunTrainGpt2("--data " + truncated + " --steps 1");
  EXPECT_EQ(short_file.exit_code, 1);
  EXPECT_NE(short_file.output.find("truncated"), std::string::npos) << short_file.output;

  // Tokens beyond the vocabulary.
  const std::string wide = TempPath("wide_tokens.bin");
  {
    std::ofstream out(wide, std::ios::binary);
    int32_t header[256] = {20240520, 1, 200};
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    std::vector<uint16_t> tokens(200, 300);
    out.write(reinterpret_cast<const char*>(tokens.data()), 400);
  }
  ProcessResult too_wide = RunTrainGpt2("--data " + wide + " --steps 1");
  EXPECT_EQ(too_wide.exit_code, 1);
  EXPECT_NE(too_wide.output.find("--vocab 301"), std::string::npos) << too_wide.output;
}

// --layer-impl: GPT-2's layers as programs of primitive ops (the reference) train the run of the
// hand-fused layers (the default) within gpt2_api_test's tolerance: the same initial values, the
// same final loss within 1e-5 relative. Primitive layers on a GPU are refused, saying why.
TEST(TrainGpt2Test, PrimitiveLayersTrainTheFusedRun) {
  const std::string run = "--steps 10 --log-every 10 --threads 1 --batch 4 --seq-len 32";
  ProcessResult fused = RunTrainGpt2(run);
  ProcessResult primitive = RunTrainGpt2(run + " --layer-impl primitive");
  ASSERT_EQ(fused.exit_code, 0) << fused.output;
  ASSERT_EQ(primitive.exit_code, 0) << primitive.output;
  const double expected = FirstMatch(fused.output, R"(final_loss=([0-9.]+))");
  ASSERT_GT(expected, 0) << fused.output;
  EXPECT_NEAR(FirstMatch(primitive.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << primitive.output;
  EXPECT_EQ(FirstMatch(primitive.output, R"(step 1/10 loss ([0-9.]+))"),
            FirstMatch(fused.output, R"(step 1/10 loss ([0-9.]+))"));
  ProcessResult bad = RunTrainGpt2("--steps 1 --layer-impl fancy");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  ProcessResult gpu = RunTrainGpt2("--steps 1 --layer-impl primitive --device cuda --workers 1");
  EXPECT_EQ(gpu.exit_code, 1) << gpu.output;
  EXPECT_NE(gpu.output.find("primitive layers run on CPUs"), std::string::npos) << gpu.output;
}

// Data parallel on two workers matches one process within the plans' tolerance (architecture.md:
// gradients are sums of per-rank partial sums); a layer split matches it exactly.
TEST(TrainGpt2Test, ALocalClusterTrainsLikeOneProcessAndALayerSplitExactly) {
  ProcessResult alone = RunTrainGpt2("--steps 20 --log-every 20 --threads 1");
  ProcessResult cluster = RunTrainGpt2("--steps 20 --log-every 20 --threads 1 --workers 2");
  ProcessResult spread =
      RunTrainGpt2("--steps 20 --log-every 20 --threads 1 --workers 2 --placement layers");
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  ASSERT_EQ(cluster.exit_code, 0) << cluster.output;
  ASSERT_EQ(spread.exit_code, 0) << spread.output;
  const double expected = FirstMatch(alone.output, R"(final_loss=([0-9.]+))");
  EXPECT_GT(expected, 0);
  EXPECT_NEAR(FirstMatch(cluster.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << cluster.output;
  EXPECT_EQ(FirstMatch(spread.output, R"(final_loss=([0-9.]+))"), expected) << spread.output;
  EXPECT_NE(cluster.output.find("cluster at"), std::string::npos) << cluster.output;
  // Gradient buckets sized from the link measured on the two workers.
  EXPECT_NE(cluster.output.find("gradient buckets"), std::string::npos) << cluster.output;
  EXPECT_NE(cluster.output.find("(measured)"), std::string::npos) << cluster.output;
}

// The pipeline flags: two stages of one worker each train the run of one process (within the
// plans' tolerance), the plan and the stage cut are printed; bad pipelines are explained.
TEST(TrainGpt2Test, APipelineOfTwoStagesTrainsLikeOneProcess) {
  ProcessResult alone = RunTrainGpt2("--steps 10 --log-every 10 --threads 1 --batch 8");
  ProcessResult piped = RunTrainGpt2(
      "--steps 10 --log-every 10 --threads 1 --batch 8 --workers 2 --pipeline-stages 2 "
      "--micro-batches 4 --schedule 1f1b");
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  ASSERT_EQ(piped.exit_code, 0) << piped.output;
  const double expected = FirstMatch(alone.output, R"(final_loss=([0-9.]+))");
  EXPECT_NEAR(FirstMatch(piped.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << piped.output;
  EXPECT_NE(piped.output.find("pipeline_stages=2 schedule=1f1b"), std::string::npos)
      << piped.output;
  EXPECT_NE(piped.output.find("pipeline stage 0: embedding"), std::string::npos) << piped.output;
  // Zero-bubble, with stages balanced by a profiling run's layer times: the same run.
  ProcessResult zero_bubble = RunTrainGpt2(
      "--steps 10 --log-every 10 --threads 1 --batch 8 --workers 2 --pipeline-stages 2 "
      "--micro-batches 4 --schedule zb-h1 --balance profile");
  ASSERT_EQ(zero_bubble.exit_code, 0) << zero_bubble.output;
  EXPECT_NEAR(FirstMatch(zero_bubble.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << zero_bubble.output;
  EXPECT_NE(zero_bubble.output.find(
                "layer times (profiled, ms per micro-batch, forward/backward/weight): embedding "),
            std::string::npos)
      << zero_bubble.output;
  // A cut given by hand (four layers): the embedding alone on stage 0, the rest on stage 1; the
  // same run.
  ProcessResult cut = RunTrainGpt2(
      "--steps 10 --log-every 10 --threads 1 --batch 8 --workers 2 --pipeline-stages 2 "
      "--micro-batches 4 --stage-layers 1,3");
  ASSERT_EQ(cut.exit_code, 0) << cut.output;
  EXPECT_NEAR(FirstMatch(cut.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << cut.output;
  EXPECT_NE(cut.output.find("pipeline stage 0: embedding | stage 1: h.0..head"), std::string::npos)
      << cut.output;

  ProcessResult unpiped = RunTrainGpt2("--steps 1 --batch 8 --balance profile");
  EXPECT_EQ(unpiped.exit_code, 0) << unpiped.output;
  EXPECT_NE(unpiped.output.find("with neither --pipeline-stages nor a memory cap or "
                                "--activation-budget there is nothing to use them"),
            std::string::npos)
      << unpiped.output;
  // Without a pipeline but under an activation budget, the memory plan prices its recomputes
  // by the profiled times, and --explain-memory predicts the planned step's time from them.
  ProcessResult budgeted = RunTrainGpt2(
      "--steps 1 --batch 8 --balance profile --activation-budget 0.5 --explain-memory");
  EXPECT_EQ(budgeted.exit_code, 0) << budgeted.output;
  EXPECT_NE(budgeted.output.find("layer times (profiled, ms per micro-batch"), std::string::npos)
      << budgeted.output;
  EXPECT_GT(FirstMatch(budgeted.output, R"(predicted step time: ([0-9.]+) ms)"), 0)
      << budgeted.output;

  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--workers 3 --pipeline-stages 2 --micro-batches 4",
       "--pipeline-stages 2 needs --workers a multiple of 2"},
      {"--workers 4 --pipeline-stages 4 --micro-batches 2 --schedule 1f1b",
       "needs at least as many micro-batches as pipeline stages"},
      {"--workers 2 --pipeline-stages 2 --micro-batches 4 --schedule zigzag",
       "schedule 'zigzag' is not one of: gpipe, 1f1b, interleaved, zb-h1"},
      {"--workers 8 --pipeline-stages 8 --micro-batches 8", "has 4 layers: use at most 4 stages"},
      {"--workers 2 --pipeline-stages 2 --micro-batches 4 --stage-layers 3,4",
       "--stage-layers 3,4: give 2 counts"},
  };
  ExpectRefused(refused);
}

// Tensor parallelism from the command line: TP 2 x DP 2 on four workers (the primitive layers by
// default) trains the run of one process with the same layers, prints each split layer's
// placement (the vocabulary-parallel embedding among them, or why it is replicated); bad
// combinations are explained.
TEST(TrainGpt2Test, TensorParallelRanksTrainLikeOneProcess) {
  ProcessResult alone =
      RunTrainGpt2("--steps 10 --log-every 10 --threads 1 --batch 8 --layer-impl primitive");
  ProcessResult split = RunTrainGpt2(
      "--steps 10 --log-every 10 --threads 1 --batch 8 --workers 4 --tensor-parallel 2");
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  ASSERT_EQ(split.exit_code, 0) << split.output;
  const double expected = FirstMatch(alone.output, R"(final_loss=([0-9.]+))");
  EXPECT_NEAR(FirstMatch(split.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << split.output;
  EXPECT_NE(split.output.find("data_parallel=2 zero_stage=0 offload=none micro_batches=1 "
                              "tensor_parallel=2"),
            std::string::npos)
      << split.output;
  EXPECT_NE(split.output.find("each layer over 2 tensor ranks:"), std::string::npos)
      << split.output;
  EXPECT_NE(split.output.find("h.0.attn: h.0.qkv_w rows split in 3 blocks"), std::string::npos)
      << split.output;
  // The byte vocabulary (256) splits over 2 ranks; 301 does not, and the driver says so.
  EXPECT_NE(split.output.find("embedding: wte rows split; output 0 all-reduced"), std::string::npos)
      << split.output;
  ProcessResult odd = RunTrainGpt2(
      "--steps 1 --log-every 1 --threads 1 --batch 8 --workers 2 --tensor-parallel 2 --vocab 301");
  ASSERT_EQ(odd.exit_code, 0) << odd.output;
  EXPECT_NE(odd.output.find("the vocabulary (301) is not a multiple of 2 tensor ranks, so the "
                            "embedding and classifier are replicated on every rank; --vocab 302"),
            std::string::npos)
      << odd.output;
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--workers 3 --tensor-parallel 2", "--tensor-parallel 2 needs --workers a multiple of 2"},
      {"--tensor-parallel 2",
       "needs --workers a multiple of 2 (D x T x P workers: D data-parallel ranks), got --workers "
       "0"},
      {"--workers 4 --tensor-parallel 4 --heads 6 --channels 96",
       "6 attention heads do not split over 4 tensor-parallel ranks"},
  };
  ExpectRefused(refused);
}

// Ten steps of batch 8 with `arguments` end at the final loss of one process running the
// primitive layers (within 1e-5): the run with them.
ProcessResult TrainsLikeOneProcess(const std::string& arguments) {
  const std::string steps = "--steps 10 --log-every 10 --threads 1 --batch 8 ";
  const ProcessResult alone = RunTrainGpt2(steps + "--layer-impl primitive");
  ProcessResult split = RunTrainGpt2(steps + arguments);
  EXPECT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_EQ(split.exit_code, 0) << split.output;
  const double expected = FirstMatch(alone.output, R"(final_loss=([0-9.]+))");
  EXPECT_NEAR(FirstMatch(split.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << split.output;
  return split;
}

// Sequence parallelism from the command line: two groups of two Ulysses ranks on four workers
// train the run of one process with the same layers, and say how the sequences split; the modes
// not built and bad degrees are explained.
TEST(TrainGpt2Test, SequenceParallelRanksTrainLikeOneProcess) {
  const ProcessResult split =
      TrainsLikeOneProcess("--workers 4 --sequence-parallel ulysses --sequence-degree 2");
  EXPECT_NE(split.output.find("sequence_parallel=2 (ulysses)"), std::string::npos) << split.output;
  EXPECT_NE(split.output.find("each sequence over 2 ranks (DeepSpeed-Ulysses; 2 group(s) of the 4 "
                              "data-parallel ranks"),
            std::string::npos)
      << split.output;
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--workers 4 --tensor-parallel 2 --sequence-parallel ring",
       "tensor parallelism (2 ranks) and sequence parallelism (2 ranks) together are not built"},
      {"--workers 2 --sequence-degree 2", "add --sequence-parallel ulysses or ring"},
      {"--workers 3 --sequence-parallel ulysses --sequence-degree 2",
       "needs --sequence-degree a divisor of them"},
      {"--workers 2 --sequence-parallel ulysses --seq-len 63", "multiple of 2"},
      {"--workers 2 --sequence-parallel ulysses --plan auto",
       "not --sequence-parallel ulysses yet"},
      {"--workers 2 --sequence-parallel megatron", "add --tensor-parallel T (T >= 2)"},
      {"--workers 2 --tensor-parallel 2 --sequence-parallel megatron --sequence-degree 2",
       "drop --sequence-degree 2"},
      {"--workers 2 --tensor-parallel 2 --sequence-parallel megatron --seq-len 63",
       "that 2 divides (63 does not)"},
      {"--workers 2 --tensor-parallel 2 --sequence-parallel megatron --vocab 257",
       "use a --vocab that 2 divides"},
  };
  ExpectRefused(refused);
}

// Ring attention from the command line: two ranks rotating keys and values train the run of one
// process, and the plan says which outputs rotate; so do two zb-h1 stages of two ring ranks cut
// inside a block (after h.0.kv1: the next stage's ring step reads the rotated block and the
// queries across the cut).
TEST(TrainGpt2Test, RingAttentionTrainsLikeOneProcess) {
  TrainsLikeOneProcess(
      "--workers 4 --sequence-parallel ring --pipeline-stages 2 --micro-batches 4 --schedule "
      "zb-h1 --stage-layers 4,8");
  const ProcessResult split = TrainsLikeOneProcess("--workers 2 --sequence-parallel ring");
  EXPECT_NE(split.output.find("sequence_parallel=2 (ring)"), std::string::npos) << split.output;
  EXPECT_NE(split.output.find("each sequence over 2 ranks (ring attention; 1 group(s) of the 2 "
                              "data-parallel ranks, each rank half of every row's positions); "
                              "keys and values rotated to the next rank after h.0.kv1 output 0 "
                              "(ring_next)"),
            std::string::npos)
      << split.output;
}

// Megatron-LM's sequence parallelism from the command line: two tensor ranks with the norms and
// residuals on half of each sequence train the run of one process, and the plan says which
// layers shard the sequence.
TEST(TrainGpt2Test, MegatronSequenceParallelismTrainsLikeOneProcess) {
  const ProcessResult split = TrainsLikeOneProcess(
      "--workers 2 --tensor-parallel 2 --sequence-parallel megatron --layer-impl primitive");
  EXPECT_NE(split.output.find("tensor_parallel=2 sequence_parallel=megatron"), std::string::npos)
      << split.output;
  EXPECT_NE(split.output.find("h.0.mid: h.0.proj_b, h.0.ln2_w, h.0.ln2_b replicated; on 1/2 of "
                              "the positions"),
            std::string::npos)
      << split.output;
  EXPECT_NE(split.output.find("output 0 reduce-scattered along the sequence"), std::string::npos)
      << split.output;
}

// --plan auto on a local cluster of four workers: it calibrates (layer times, the collective
// link), lists the best plans, says which it chose and why, and trains the losses of one process
// (as every plan does); the calibration is cached for the next run, --recalibrate measures again,
// a plan flag given fixes its dimension, and a cap nothing fits is refused with the fix.
TEST(TrainGpt2Test, PlanAutoChoosesAPlanAndTrainsLikeOneProcess) {
  const std::string cache =
      (std::filesystem::temp_directory_path() / fmt::format("tessera_auto_{}", getpid())).string();
  std::filesystem::remove_all(cache);
  const std::string env = "TESSERA_CACHE_DIR=" + cache;
  const auto run = [&env](const std::string& arguments) {
    return RunBinaryWithin("train_gpt2", arguments, std::chrono::minutes(3), env);
  };
  // One round of each calibration measurement: what a figure is the median of is
  // plan_calibration_test's; here, that the search calibrates, caches and chooses.
  const std::string common =
      "--steps 10 --log-every 10 --threads 1 --batch 8 --calibration-rounds 1";
  ProcessResult alone = RunTrainGpt2(common);
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  const double expected = FirstMatch(alone.output, R"(final_loss=([0-9.]+))");
  ASSERT_GT(expected, 0);

  BoundedRun first = run(common + " --workers 4 --plan auto");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NEAR(FirstMatch(first.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << first.output;
  EXPECT_NE(first.output.find("calibrating: collectives among 4 workers"), std::string::npos)
      << first.output;
  EXPECT_NE(first.output.find("calibration measured"), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("plans considered"), std::string::npos) << first.output;
  std::smatch chose;
  ASSERT_TRUE(std::regex_search(
      first.output, chose,
      std::regex(R"(--plan auto chose (D\d x (T\d( SP)? x )?P\d[^(]*) \(--workers)")))
      << first.output;
  // The table's first line is the plan chosen.
  EXPECT_NE(first.output.find("  1  " + chose[1].str()), std::string::npos) << first.output;

  BoundedRun cached = run(common + " --workers 4 --plan auto");
  ASSERT_EQ(cached.exit_code, 0) << cached.output;
  EXPECT_NE(cached.output.find("calibration cached in " + cache), std::string::npos)
      << cached.output;
  EXPECT_EQ(cached.output.find("calibrating:"), std::string::npos) << cached.output;
  BoundedRun again =
      run("--steps 0 --threads 1 --batch 8 --workers 4 --plan auto --recalibrate "
          "--calibration-rounds 1");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("calibration measured"), std::string::npos) << again.output;

  // Every dimension given but the data-parallel one (the tensor degree too: left free, a
  // calibration measured beside other tests once chose D2 x T2 x P1 M2 here).
  BoundedRun fixed = run(common +
                         " --workers 4 --plan auto --pipeline-stages 1 --micro-batches 2 "
                         "--zero-stage 1 --tensor-parallel 1");
  ASSERT_EQ(fixed.exit_code, 0) << fixed.output;
  EXPECT_NE(fixed.output.find("--plan auto chose D4 x P1 M2 ZeRO-1"), std::string::npos)
      << fixed.output;
  EXPECT_NEAR(FirstMatch(fixed.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << fixed.output;
  // The four-worker search calibrated one rank of each tensor split (T 2 and 4) beside the
  // whole model; a degree given fixes it, and the plan chosen trains the same losses.
  EXPECT_NE(first.output.find("calibrating: layers of one of 2 tensor ranks"), std::string::npos)
      << first.output;
  EXPECT_NE(first.output.find("calibrating: layers of one of 4 tensor ranks"), std::string::npos)
      << first.output;
  // ... and probed pairs of tensor ranks on the workers for what a collective waits there.
  EXPECT_NE(first.output.find("calibrating: 2 tensor-parallel pairs at once, "), std::string::npos)
      << first.output;
  // ... and a pipeline over the four, for what an object pushed between stages waits there.
  EXPECT_NE(first.output.find("calibrating: a pipeline of 4 stages, "), std::string::npos)
      << first.output;
  // ... and the same sharding sequences, for what their reduce-scatters and all-gathers wait.
  EXPECT_NE(first.output.find("calibrating: 2 tensor-parallel pairs at once sharding sequences, "),
            std::string::npos)
      << first.output;
  // Workers bound to cores: another calibration (its own cache entry); the one read back from the
  // cache makes the same choice with the same predicted step as the measured one (its groups of
  // shared cores put on this cluster's workers), and both train the same losses.
  BoundedRun bound = run(common + " --workers 4 --bind-cores --plan auto");
  ASSERT_EQ(bound.exit_code, 0) << bound.output;
  EXPECT_NE(bound.output.find("calibration measured"), std::string::npos) << bound.output;
  BoundedRun bound_cached = run(common + " --workers 4 --bind-cores --plan auto");
  ASSERT_EQ(bound_cached.exit_code, 0) << bound_cached.output;
  EXPECT_NE(bound_cached.output.find("calibration cached in " + cache), std::string::npos)
      << bound_cached.output;
  const std::regex chosen_line(R"(--plan auto chose [^\n]*)");
  std::smatch measured_choice, cached_choice;
  ASSERT_TRUE(std::regex_search(bound.output, measured_choice, chosen_line)) << bound.output;
  ASSERT_TRUE(std::regex_search(bound_cached.output, cached_choice, chosen_line))
      << bound_cached.output;
  EXPECT_EQ(measured_choice.str(), cached_choice.str());
  for (const BoundedRun* r : {&bound, &bound_cached}) {
    EXPECT_NEAR(FirstMatch(r->output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
        << r->output;
  }
  BoundedRun tensor = run(common + " --workers 2 --plan auto --tensor-parallel 2");
  ASSERT_EQ(tensor.exit_code, 0) << tensor.output;
  EXPECT_NE(tensor.output.find("--plan auto chose D1 x T2"), std::string::npos) << tensor.output;
  EXPECT_NEAR(FirstMatch(tensor.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << tensor.output;

  // Under a cap the workers hold (a fresh cache: every probe runs on the capped workers), the
  // probes are planned under it too, and the chosen plan trains the same losses.
  BoundedRun capped =
      RunBinaryWithin("train_gpt2", common + " --workers 2 --plan auto --host-memory-gib 0.004",
                      std::chrono::minutes(3), env + "/capped");
  ASSERT_EQ(capped.exit_code, 0) << capped.output;
  EXPECT_NE(capped.output.find("calibrating: 2 ranks at once"), std::string::npos) << capped.output;
  EXPECT_EQ(capped.output.find("the probe step failed"), std::string::npos) << capped.output;
  EXPECT_NEAR(FirstMatch(capped.output, R"(final_loss=([0-9.]+))"), expected, 1e-5 * expected)
      << capped.output;

  BoundedRun refused = run(common + " --workers 4 --plan auto --host-memory-gib 0.0001");
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("no plan fits 4 workers"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("--host-memory-gib"), std::string::npos) << refused.output;
  std::filesystem::remove_all(cache);
}

// ZeRO-3 on 2 workers with checkpoints, resumed on 4 workers at ZeRO-1: the same final loss as
// an uninterrupted run, and a per-worker report of peak model state and bytes sent.
TEST(TrainGpt2Test, ZeroRunsCheckpointAndResumeOnAnotherPlan) {
  const std::string dir = TempPath("train_gpt2_checkpoints");
  std::filesystem::remove_all(dir);
  ProcessResult whole = RunTrainGpt2("--steps 12 --log-every 12 --threads 1");
  ProcessResult first = RunTrainGpt2(
      "--steps 6 --log-every 6 --threads 1 --workers 2 "
      "--zero-stage 3 --checkpoint-dir " +
      dir);
  ProcessResult second = RunTrainGpt2(
      "--steps 12 --log-every 6 --threads 1 --workers 4 "
      "--zero-stage 1 --grad-accum 2 --checkpoint-dir " +
      dir + " --resume");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  const double whole_loss = FirstMatch(whole.output, R"(final_loss=([0-9.]+))");
  EXPECT_NEAR(FirstMatch(second.output, R"(final_loss=([0-9.]+))"), whole_loss, 1e-5 * whole_loss)
      << second.output;
  EXPECT_GT(FirstMatch(first.output, R"(worker rank 1 \(worker\d+\): peak params ([0-9.]+) MB)"), 0)
      << first.output;
  EXPECT_GT(FirstMatch(second.output, R"(worker rank 3 .*sent ([0-9.]+) MB/step)"), 0)
      << second.output;
  // Impossible plans are refused before anything starts, saying what to change.
  ProcessResult stage5 = RunTrainGpt2("--steps 1 --workers 2 --zero-stage 5");
  EXPECT_NE(stage5.exit_code, 0);
  EXPECT_NE(stage5.output.find("ZeRO stage 5 does not exist: use 0"), std::string::npos)
      << stage5.output;
  ProcessResult no_dir = RunTrainGpt2("--steps 1 --resume");
  EXPECT_NE(no_dir.output.find("--resume needs --checkpoint-dir"), std::string::npos)
      << no_dir.output;
}

// Children of `parent` that are still running (zombies count as gone).

TEST(TrainGpt2Test, KillingTheDriverTakesItsLocalClusterDown) {
  const pid_t driver = ::fork();
  ASSERT_GE(driver, 0);
  if (driver == 0) {
    const std::string binary = BinaryPath("train_gpt2");
    ::freopen("/dev/null", "w", stdout);
    ::freopen("/dev/null", "w", stderr);
    ::execl(binary.c_str(), binary.c_str(), "--workers", "2", "--threads", "1", "--steps",
            "1000000", "--log-every", "1000000", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  std::vector<pid_t> children;
  Eventually(
      [&] {
        children = LiveChildren(driver);
        return children.size() >= 3;
      },
      std::chrono::seconds(15));
  ASSERT_EQ(children.size(), 3u) << "a scheduler and two workers";
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // training is under way
  ASSERT_EQ(::kill(driver, SIGKILL), 0);
  int status = 0;
  ::waitpid(driver, &status, 0);
  Eventually([&] { return std::all_of(children.begin(), children.end(), ProcessGone); },
             std::chrono::seconds(5));
  for (pid_t child : children)
    EXPECT_TRUE(ProcessGone(child)) << "pid " << child << " outlived its driver";
}

TEST(TrainGpt2Test, AnUnreachableClusterIsReported) {
  const std::string token = TempPath("tessera_test_token");
  std::ofstream(token) << "0123456789abcdef\n";
  ProcessResult run = RunTrainGpt2("--steps 1 --address 127.0.0.1:1 --token-file " + token);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.output.find("127.0.0.1:1"), std::string::npos) << run.output;
}

// 5000 tokens of a ramp 0..96 repeating, as uint16, after llm.c's 256-int32 header or (nanoGPT's
// way) none.
void WriteRampTokens(const std::string& path, bool llmc_header) {
  std::ofstream out(path, std::ios::binary);
  if (llmc_header) {
    int32_t header[256] = {20240520, 1, 5000};
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
  }
  for (int i = 0; i < 5000; ++i) {
    const uint16_t token = static_cast<uint16_t>(i % 97);
    out.write(reinterpret_cast<const char*>(&token), 2);
  }
}

TEST(TrainGpt2Test, ReadsLlmcTokenFiles) {
  const std::string path = TempPath("ramp_tokens.bin");
  WriteRampTokens(path, /*llmc_header=*/true);
  ProcessResult run = RunTrainGpt2("--data " + path + " --vocab 97 --steps 30 --log-every 30");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  // A repeating ramp is easy to predict: the loss must fall clearly.
  EXPECT_LT(FirstMatch(run.output, R"(final_loss=([0-9.]+))"),
            FirstMatch(run.output, R"(step 1/30 loss ([0-9.]+))"));
}

// nanoGPT's train.bin (raw uint16 tokens, no header): refused by content with the flag named, and
// with --data-format uint16 the same ramp as above trains, its loss falling; the llm.c file of
// the same tokens gives the same losses (the same tokens, read two ways).
TEST(TrainGpt2Test, ReadsNanoGptsHeaderlessTokensWhenAskedFor) {
  const std::string raw = TempPath("ramp_raw.bin");
  const std::string llmc = TempPath("ramp_llmc.bin");
  WriteRampTokens(raw, /*llmc_header=*/false);
  WriteRampTokens(llmc, /*llmc_header=*/true);
  const std::string run = " --vocab 97 --steps 30 --log-every 30";
  ProcessResult guessed = RunTrainGpt2("--data " + raw + run);
  EXPECT_EQ(guessed.exit_code, 1) << guessed.output;
  EXPECT_NE(guessed.output.find("--data-format uint16"), std::string::npos) << guessed.output;
  ProcessResult asked = RunTrainGpt2("--data " + raw + " --data-format uint16" + run);
  ASSERT_EQ(asked.exit_code, 0) << asked.output;
  EXPECT_LT(FirstMatch(asked.output, R"(final_loss=([0-9.]+))"),
            FirstMatch(asked.output, R"(step 1/30 loss ([0-9.]+))"));
  ProcessResult headed = RunTrainGpt2("--data " + llmc + run);
  ASSERT_EQ(headed.exit_code, 0) << headed.output;
  EXPECT_EQ(FirstMatch(asked.output, R"(final_loss=([0-9.]+))"),
            FirstMatch(headed.output, R"(final_loss=([0-9.]+))"));
}

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

std::string FirstText(const std::string& text, const std::string& pattern) {
  std::smatch match;
  if (!std::regex_search(text, match, std::regex(pattern))) return "";
  return match[1];
}

// --export writes llm.c's format; --init-from of that file starts from exactly the exported
// model: its parameters come back bit-exactly (exported again untrained: the same bytes), its
// validation loss before any step is the exporting run's final one, and it trains on, here on a
// local cluster with ZeRO-2.
TEST(TrainGpt2Test, ExportThenInitFromStartsFromTheExportedModel) {
  const std::string exported = TempPath("train_gpt2_export.bin");
  const std::string again = TempPath("train_gpt2_export_again.bin");
  std::filesystem::remove(exported);
  std::filesystem::remove(again);
  const std::string shape = " --batch 4 --seq-len 32 --threads 1 --eval-batches 2";
  ProcessResult first =
      RunTrainGpt2("--steps 4 --log-every 4 --eval-every 4 --export " + exported + shape);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("exported to " + exported), std::string::npos) << first.output;
  const std::string final_val_loss = FirstText(first.output, R"(eval step 4: val_loss ([0-9.]+))");
  ASSERT_FALSE(final_val_loss.empty()) << first.output;

  ProcessResult loaded = RunTrainGpt2("--init-from " + exported +
                                      " --steps 0 --eval-every 1 --export " + again + shape);
  ASSERT_EQ(loaded.exit_code, 0) << loaded.output;
  EXPECT_NE(loaded.output.find("parameters from " + exported), std::string::npos) << loaded.output;
  EXPECT_EQ(FirstText(loaded.output, R"(eval step 0: val_loss ([0-9.]+))"), final_val_loss)
      << loaded.output;
  const std::string exported_bytes = FileBytes(exported);
  EXPECT_GT(exported_bytes.size(), 1024u);
  EXPECT_TRUE(FileBytes(again) == exported_bytes) << "the parameters did not round-trip exactly";

  ProcessResult trained = RunTrainGpt2(
      "--init-from " + exported + " --steps 2 --log-every 1 --workers 2 --zero-stage 2" + shape);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  EXPECT_GT(FirstMatch(trained.output, R"(step 2/2 loss ([0-9.]+))"), 0) << trained.output;
}

TEST(TrainGpt2Test, InitFromRefusesConflictingFlagsAndBadFiles) {
  const std::string model = TempPath("train_gpt2_init_model.bin");
  ProcessResult made =
      RunTrainGpt2("--steps 0 --batch 2 --seq-len 32 --threads 1 --export " + model);
  ASSERT_EQ(made.exit_code, 0) << made.output;

  // The model's shape is the file's: a flag that changes it is refused, naming both.
  ProcessResult layers = RunTrainGpt2("--init-from " + model + " --layers 3 --steps 1");
  EXPECT_EQ(layers.exit_code, 1) << layers.output;
  EXPECT_NE(layers.output.find("--layers 3 conflicts with --init-from '" + model +
                               "', which holds a model with layers=2"),
            std::string::npos)
      << layers.output;
  ProcessResult preset = RunTrainGpt2("--init-from " + model + " --preset small --steps 1");
  EXPECT_EQ(preset.exit_code, 1) << preset.output;
  EXPECT_NE(preset.output.find("--preset small (layers=6 channels=384"), std::string::npos)
      << preset.output;
  EXPECT_NE(preset.output.find("max_seq_len=32"), std::string::npos) << preset.output;
  // Repeating the file's shape is fine.
  ProcessResult same = RunTrainGpt2("--init-from " + model +
                                    " --layers 2 --max-seq-len 32 --steps 1 --batch 2 --threads 1");
  EXPECT_EQ(same.exit_code, 0) << same.output;
  ProcessResult resume = RunTrainGpt2("--init-from " + model + " --resume --checkpoint-dir " +
                                      TempPath("train_gpt2_init_ckpt"));
  EXPECT_EQ(resume.exit_code, 1) << resume.output;
  EXPECT_NE(resume.output.find("--init-from and --resume"), std::string::npos) << resume.output;

  const std::string bytes = FileBytes(model);
  const std::string truncated = TempPath("train_gpt2_truncated.bin");
  std::ofstream(truncated, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  ProcessResult cut = RunTrainGpt2("--init-from " + truncated + " --steps 1");
  EXPECT_EQ(cut.exit_code, 1) << cut.output;
  EXPECT_NE(cut.output.find("'" + truncated + "' is truncated"), std::string::npos) << cut.output;

  const std::string tokens = TempPath("train_gpt2_not_a_model.bin");
  {
    std::ofstream out(tokens, std::ios::binary);
    int32_t header[256] = {20240520, 1, 0};
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
  }
  ProcessResult magic = RunTrainGpt2("--init-from " + tokens + " --steps 1");
  EXPECT_EQ(magic.exit_code, 1) << magic.output;
  EXPECT_NE(magic.output.find("'" + tokens + "' is not an llm.c GPT-2 checkpoint"),
            std::string::npos)
      << magic.output;
  EXPECT_NE(magic.output.find("magic number is 20240326"), std::string::npos) << magic.output;
}

}  // namespace
}  // namespace tessera::testing
