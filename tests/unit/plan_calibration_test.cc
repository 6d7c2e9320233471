// Calibrating for the plan search (training/plan_calibration.h) in this process: the row counts
// it profiles, the figures a calibration without workers measures (every layer's times, the
// per-task overhead, the rate of the tasks that are no layer's), the cache (every figure read
// back as written, another setup's file refused, a damaged one named), and a refit on recorded
// probe steps against the simulation it fits. (On a cluster, with the links and the probes: the
// `--plan auto` and `tessera plan` integration tests.)
#include "training/plan_calibration.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/gpt2.h"
#include "planner/step_graph.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

ModelSpec TwoBlocks() { return *BuildGpt2(Gpt2Config{2, 32, 4, 64, 16}); }

TrainingPlan Base() { return TrainingPlan{.batch = 8, .seq_len = 16}; }

// The rows a micro-batch of each candidate (without tensor parallelism) has: the batch over its
// data ranks and micro-batches, each count once, ascending.
TEST(PlanCalibrationTest, TheRowsProfiledAreTheCandidatesMicroBatchShapes) {
  SearchSpace space;
  space.workers = 2;
  space.max_micro_batches = 4;
  space.tensor_parallel = {1};
  EXPECT_EQ(CandidateRows(TwoBlocks(), Base(), space), (std::vector<int64_t>{1, 2, 4, 8}));
  space.max_micro_batches = 1;
  EXPECT_EQ(CandidateRows(TwoBlocks(), Base(), space), (std::vector<int64_t>{4, 8}));
}

// In this process (no workers): each row count's layer times, the overhead per task and the rate
// of the optimizer's tasks, measured; no links, no probes.
TEST(PlanCalibrationTest, WithoutWorkersTheLayersAndTheOtherTasksAreMeasured) {
  const ModelSpec model = TwoBlocks();
  CalibrationRequest request;
  request.rows = {2, 4};
  request.profile_steps = 1;
  request.rounds = 1;
  std::vector<std::string> said;
  ASSERT_OK_AND_ASSIGN(Calibration calibration,
                       Calibrate(model, Base(), request, ExecutorOptions{}, nullptr,
                                 [&said](const std::string& line) { said.push_back(line); }));
  ASSERT_EQ(calibration.layers.size(), 2u);
  for (const LayerTimesAtRows& at : calibration.layers) {
    ASSERT_EQ(at.layer_ms.size(), model.layers.size());
    for (const OpCosts& ms : at.layer_ms) EXPECT_GT(ms.forward, 0.0);
  }
  EXPECT_GT(calibration.other_ms_per_unit, 0.0);
  EXPECT_GE(calibration.task_overhead_ms, 0.0);
  EXPECT_FALSE(calibration.links.collective.measured());
  EXPECT_EQ(calibration.sharing.capacity, 0.0);
  ASSERT_FALSE(said.empty());
  EXPECT_THAT(said.back(), HasSubstr("tasks of no layer"));
  request.rows.clear();
  EXPECT_EQ(Calibrate(model, Base(), request, ExecutorOptions{}, nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

Calibration EveryFigure() {
  Calibration calibration;
  calibration.layers = {{2, {{1.5, 2.5, 0.5}, {0.25, 0.75, 0}}}, {4, {{3, 5, 1}, {0.5, 1.5, 0}}}};
  calibration.tensor_splits = {{2, {{2, {{0.75, 1.25, 0.25}, {0.125, 0.375, 0}}}}}};
  calibration.task_overhead_ms = 0.0125;
  calibration.other_ms_per_unit = 3.5e-9;
  calibration.step_overhead_ms = 0.4;
  calibration.compute_scale = 1.07;
  calibration.links.collective = CollectiveLink{42, 750};
  calibration.links.collective_group = 4;
  calibration.links.point_to_point = CollectiveLink{67, 8230};
  calibration.links.shared_push_latency_us = 912.5;
  calibration.links.group_latency = {{4, 175.5}, {8, 310.25}};
  calibration.links.sequence_shard_latency = {{2, 96.5}};
  calibration.links.exchange_latency = {{4, 61.75}};
  calibration.links.staged_latency = {{StepLinks::GroupWait::kAllReduce, 2, 262.5},
                                      {StepLinks::GroupWait::kExchange, 2, 86.25}};
  calibration.sharing.capacity = 1.35;
  calibration.sharing.groups = {CoreGroup{{WorkerId(3), WorkerId(5)}, 0.25},
                                CoreGroup{{WorkerId(4)}, 0.75}};
  calibration.probe_steps = {{"one rank on one worker", {20.5, 21.25, 20.75}},
                             {"4 ranks at once", {}}};
  calibration.probe_workers = {WorkerId(1), WorkerId(3), WorkerId(4), WorkerId(5)};
  calibration.measured_collective = CollectiveLink{38, 760};
  return calibration;
}

TEST(PlanCalibrationTest, TheCacheReadsBackEveryFigureForItsOwnKeyOnly) {
  const ModelSpec model = TwoBlocks();
  CalibrationRequest request;
  request.rows = {2, 4};
  const std::string key = CalibrationKey(model, Base(), request, 1);
  const std::string dir = TempPath("calibration-cache");
  std::filesystem::remove_all(dir);
  const std::string path = CalibrationPath(dir, key);
  EXPECT_EQ(LoadCalibration(path, key).status().code(), StatusCode::kNotFound);

  const Calibration written = EveryFigure();
  ASSERT_OK(SaveCalibration(path, key, written));  // makes the directory
  ASSERT_OK_AND_ASSIGN(const Calibration read, LoadCalibration(path, key));
  ASSERT_EQ(read.layers.size(), written.layers.size());
  for (size_t i = 0; i < read.layers.size(); ++i) {
    EXPECT_EQ(read.layers[i].rows, written.layers[i].rows);
    ASSERT_EQ(read.layers[i].layer_ms.size(), written.layers[i].layer_ms.size());
    for (size_t l = 0; l < read.layers[i].layer_ms.size(); ++l) {
      EXPECT_EQ(read.layers[i].layer_ms[l].forward, written.layers[i].layer_ms[l].forward);
      EXPECT_EQ(read.layers[i].layer_ms[l].backward, written.layers[i].layer_ms[l].backward);
      EXPECT_EQ(read.layers[i].layer_ms[l].weight, written.layers[i].layer_ms[l].weight);
    }
  }
  ASSERT_EQ(read.tensor_splits.size(), 1u);
  EXPECT_EQ(read.tensor_splits[0].tensor_parallel, 2);
  ASSERT_EQ(read.tensor_splits[0].layers.size(), 1u);
  EXPECT_EQ(read.tensor_splits[0].layers[0].layer_ms[0].backward, 1.25);
  EXPECT_EQ(read.task_overhead_ms, written.task_overhead_ms);
  EXPECT_EQ(read.other_ms_per_unit, written.other_ms_per_unit);
  EXPECT_EQ(read.step_overhead_ms, written.step_overhead_ms);
  EXPECT_EQ(read.compute_scale, written.compute_scale);
  EXPECT_EQ(read.links.collective.latency_us, 42);
  EXPECT_EQ(read.links.collective.bytes_per_us, 750);
  EXPECT_EQ(read.links.collective_group, 4);
  EXPECT_EQ(read.links.point_to_point.latency_us, 67);
  EXPECT_EQ(read.links.point_to_point.bytes_per_us, 8230);
  EXPECT_EQ(read.links.shared_push_latency_us, 912.5);
  ASSERT_EQ(read.links.group_latency.size(), 2u);
  EXPECT_EQ(read.links.group_latency[0].members, 4);
  EXPECT_EQ(read.links.group_latency[0].latency_us, 175.5);
  EXPECT_EQ(read.links.group_latency[1].members, 8);
  EXPECT_EQ(read.links.group_latency[1].latency_us, 310.25);
  ASSERT_EQ(read.links.sequence_shard_latency.size(), 1u);
  EXPECT_EQ(read.links.sequence_shard_latency[0].members, 2);
  EXPECT_EQ(read.links.sequence_shard_latency[0].latency_us, 96.5);
  ASSERT_EQ(read.links.exchange_latency.size(), 1u);
  EXPECT_EQ(read.links.exchange_latency[0].members, 4);
  EXPECT_EQ(read.links.exchange_latency[0].latency_us, 61.75);
  ASSERT_EQ(read.links.staged_latency.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(read.links.staged_latency[i].wait, written.links.staged_latency[i].wait);
    EXPECT_EQ(read.links.staged_latency[i].members, 2);
    EXPECT_EQ(read.links.staged_latency[i].latency_us, written.links.staged_latency[i].latency_us);
  }
  EXPECT_EQ(read.sharing.capacity, 1.35);
  ASSERT_EQ(read.sharing.groups.size(), 2u);
  EXPECT_EQ(read.sharing.groups[0].workers, (std::vector<WorkerId>{WorkerId(3), WorkerId(5)}));
  EXPECT_EQ(read.sharing.groups[0].share, 0.25);
  EXPECT_EQ(read.sharing.groups[1].workers, std::vector<WorkerId>{WorkerId(4)});
  EXPECT_EQ(read.sharing.groups[1].share, 0.75);
  ASSERT_EQ(read.probe_steps.size(), 2u);
  EXPECT_EQ(read.probe_steps[0].what, "one rank on one worker");
  EXPECT_EQ(read.probe_steps[0].ms, written.probe_steps[0].ms);
  EXPECT_EQ(read.probe_steps[1].what, "4 ranks at once");
  EXPECT_EQ(read.probe_workers, written.probe_workers);
  EXPECT_EQ(read.measured_collective.latency_us, 38);
  EXPECT_EQ(read.measured_collective.bytes_per_us, 760);
  EXPECT_TRUE(read.probe_steps[1].ms.empty());
  // No key given: whichever setup the file holds (bench_plan_search --replay reads its own).
  EXPECT_OK(LoadCalibration(path, "").status());

  // Another setup (here: more rounds) has another key: this file is not its calibration.
  CalibrationRequest more = request;
  more.rounds = request.rounds + 2;
  const std::string other_key = CalibrationKey(model, Base(), more, 1);
  EXPECT_NE(other_key, key);
  const Result<Calibration> other = LoadCalibration(path, other_key);
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(other.status().message(), HasSubstr("another setup"));
  // Workers bound to cores are another setup too (how many share each group, not which ids).
  CalibrationRequest bound = request;
  bound.core_groups = {CoreGroup{{WorkerId(1), WorkerId(3)}, 0.5},
                       CoreGroup{{WorkerId(2), WorkerId(4)}, 0.5}};
  CalibrationRequest bound_again = request;
  bound_again.core_groups = {CoreGroup{{WorkerId(7), WorkerId(8)}, 0.5},
                             CoreGroup{{WorkerId(9), WorkerId(6)}, 0.5}};
  EXPECT_NE(CalibrationKey(model, Base(), bound, 1), key);
  EXPECT_EQ(CalibrationKey(model, Base(), bound, 1), CalibrationKey(model, Base(), bound_again, 1));

  // A damaged file is named, with what to do: cut short, or a kind of wait it cannot know.
  std::ifstream saved(path);
  std::string text((std::istreambuf_iterator<char>(saved)), std::istreambuf_iterator<char>());
  const size_t exchange = text.find("\"exchange\"", text.find("staged_latency"));
  ASSERT_NE(exchange, std::string::npos) << text;
  text.replace(exchange, 10, "\"gossip\"");
  std::ofstream(path, std::ios::trunc) << text;
  const Result<Calibration> unknown = LoadCalibration(path, key);
  EXPECT_EQ(unknown.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(unknown.status().message(), HasSubstr("unknown wait 'gossip'"));
  std::ofstream(path, std::ios::trunc) << "{\"key\": ";
  const Result<Calibration> damaged = LoadCalibration(path, key);
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(damaged.status().message(), HasSubstr(path));
  EXPECT_THAT(damaged.status().message(), HasSubstr("delete it"));
  std::filesystem::remove_all(dir);
}

// The simulated step of `plan` on `calibration` (what the calibration's fits bisect on).
double SimulatedMs(const ModelSpec& model, const TrainingPlan& plan,
                   const Calibration& calibration) {
  const Result<StepGraph> step = PlanTrainingStep(model, plan, CpuRegistry());
  EXPECT_OK(step.status());
  if (!step.ok()) return 0;
  const Result<SimulatedStep> simulated =
      SimulatePlannedStep(*step, model, plan.memory, calibration, CpuRegistry());
  EXPECT_OK(simulated.status());
  return simulated.ok() ? simulated->step_ms : 0;
}

// Fitted again on the probe steps a calibration recorded, with no worker: two workers without
// measured links make three probes (one rank on one worker at 4 and 8 rows, both ranks at
// once). Recorded as 1.2x their simulated steps plus 0.5 ms, the one rank's give back that scale
// and constant exactly; the ranks at once, recorded at twice their simulated step, a sharing of
// the machine that puts the simulation on it. A second refit gives the same figures; probes
// another request would make, or none, are refused.
// What a refit works on: a calibration measured in this process whose layers at 8 rows take twice
// their time at 4 (whatever one profile step measured: beside other tests, the 8-row profile once
// came out the faster), a request for two workers, and the three probes' plans it makes.
struct Probed {
  ModelSpec model = TwoBlocks();
  Calibration measured;
  CalibrationRequest request;
  TrainingPlan one, other, both;
  TrainingPlan zero;  // both ZeRO-3 ranks at once, 4 micro-batches (probed where the link is)
};
void MeasureForARefit(Probed& probed) {
  probed.request.rows = {4, 8};
  probed.request.profile_steps = 1;
  probed.request.rounds = 1;
  ASSERT_OK_AND_ASSIGN(probed.measured,
                       Calibrate(probed.model, Base(), probed.request, ExecutorOptions{}, nullptr));
  ASSERT_EQ(probed.measured.layers.size(), 2u);
  ASSERT_EQ(probed.measured.layers[1].rows, 8);
  probed.measured.layers[1].layer_ms = probed.measured.layers[0].layer_ms;
  for (OpCosts& costs : probed.measured.layers[1].layer_ms) {
    costs.forward *= 2;
    costs.backward *= 2;
    costs.weight *= 2;
  }
  probed.request.workers = {WorkerId(1), WorkerId(2)};
  probed.one = Base();
  probed.one.batch = 4;
  probed.one.parallel.workers = {WorkerId(1)};
  probed.other = probed.one;
  probed.other.batch = 8;
  probed.both = probed.one;
  probed.both.batch = 8;
  probed.both.parallel.data_parallel = 2;
  probed.both.parallel.workers = probed.request.workers;
  probed.zero = probed.both;
  probed.zero.parallel.zero_stage = 3;
  probed.zero.parallel.micro_batches = 4;
}

// The measured calibration with a link measured between the probes' workers: with it, the
// probes include the ZeRO-3 ranks' (whose plan takes the link).
Calibration WithTheLink(Probed& probed) {
  Calibration calibration = probed.measured;
  calibration.measured_collective = CollectiveLink{.latency_us = 20, .bytes_per_us = 1000};
  calibration.links.collective = calibration.measured_collective;
  calibration.links.collective_group = 2;
  probed.zero.parallel.link = calibration.links.collective;
  return calibration;
}

TEST(PlanCalibrationTest, ARefitPutsTheSimulationOnTheRecordedProbeSteps) {
  Probed probed;
  ASSERT_NO_FATAL_FAILURE(MeasureForARefit(probed));
  const ModelSpec& model = probed.model;
  const Calibration& measured = probed.measured;
  const CalibrationRequest& request = probed.request;
  const TrainingPlan &one = probed.one, &other = probed.other, &both = probed.both;
  const double one_ms = SimulatedMs(model, one, measured);
  const double other_ms = SimulatedMs(model, other, measured);
  ASSERT_GT(other_ms, one_ms);
  Calibration recorded = measured;
  recorded.probe_steps = {{"one rank on one worker", {1.2 * one_ms + 0.5}},
                          {"one rank on one worker", {1.2 * other_ms + 0.5}},
                          {"2 ranks at once", {}}};
  Calibration scaled = measured;
  scaled.compute_scale = 1.2;
  scaled.step_overhead_ms = 0.5;
  const double both_ms = 2 * SimulatedMs(model, both, scaled);
  recorded.probe_steps[2].ms = {both_ms};
  std::vector<std::string> said;
  ASSERT_OK_AND_ASSIGN(const Calibration refit, RefitCalibration(model, Base(), request, recorded,
                                                                 [&said](const std::string& line) {
                                                                   said.push_back(line);
                                                                 }));
  EXPECT_NEAR(refit.compute_scale, 1.2, 1e-9);
  EXPECT_NEAR(refit.step_overhead_ms, 0.5, 1e-9);
  EXPECT_GT(refit.sharing.capacity, 0);
  EXPECT_LT(refit.sharing.capacity, 2);
  EXPECT_NEAR(SimulatedMs(model, both, refit), both_ms, 1e-3 * both_ms);
  EXPECT_EQ(refit.probe_steps.size(), 3u);
  ASSERT_FALSE(said.empty());
  EXPECT_THAT(said.back(), HasSubstr("room for"));
  // The fitted figures go back to their measured state first: refitting a refit changes nothing.
  ASSERT_OK_AND_ASSIGN(const Calibration again, RefitCalibration(model, Base(), request, refit));
  EXPECT_EQ(again.compute_scale, refit.compute_scale);
  EXPECT_EQ(again.step_overhead_ms, refit.step_overhead_ms);
  EXPECT_EQ(again.sharing.capacity, refit.sharing.capacity);

  // A pair's fitted wait is kept as the collective link's latency: a refit starts from the link
  // as measured (no pair is probed here, so it stays so).
  Calibration linked = recorded;
  linked.measured_collective = CollectiveLink{44, 1000};
  linked.links.collective = CollectiveLink{158, 1000};
  ASSERT_OK_AND_ASSIGN(const Calibration relinked,
                       RefitCalibration(model, Base(), request, linked));
  EXPECT_EQ(relinked.links.collective.latency_us, 44);

  CalibrationRequest three = request;
  three.workers.push_back(WorkerId(3));
  const Result<Calibration> other_probes = RefitCalibration(model, Base(), three, recorded);
  EXPECT_EQ(other_probes.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(other_probes.status().message(), HasSubstr("calibrate again"));
  const Result<Calibration> none = RefitCalibration(model, Base(), request, measured);
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("recorded no probe steps"));
}

// Probes recorded with what their steps took outside their tasks (their timelines): that is
// fitted as a constant, a cost per worker past the first and a cost per task of the worker that
// runs the most, over every probe (the slope between the two-worker probes, which run different
// counts of tasks), and the one rank's steps less it give the scale. Recorded as 1.2x the
// simulated steps plus 0.3 ms + 0.1 ms a worker past the first + 2 us a task, the refit gives
// back all four, and the simulation of a plan adds the overhead its workers and its busiest
// worker's tasks make.
TEST(PlanCalibrationTest, ARefitFitsTheStepsOverheadOnTheProbesTimelines) {
  Probed probed;
  ASSERT_NO_FATAL_FAILURE(MeasureForARefit(probed));
  const ModelSpec& model = probed.model;
  Calibration recorded = WithTheLink(probed);
  const auto overhead = [&](const TrainingPlan& plan) {
    const Result<StepGraph> step = PlanTrainingStep(model, plan, CpuRegistry());
    EXPECT_OK(step.status());
    if (!step.ok()) return 0.0;
    const WorkerLoad load = WorkerLoadOf(step->graph);
    return 0.3 + 0.1 * static_cast<double>(load.workers - 1) +
           0.002 * static_cast<double>(load.most_tasks);
  };
  // ZeRO-3's gathers make its workers busier than the ranks' all-reduces do theirs.
  ASSERT_GT(overhead(probed.zero), overhead(probed.both));
  ASSERT_GT(overhead(probed.both), overhead(probed.one) + 0.1);
  Calibration scaled = recorded;
  scaled.compute_scale = 1.2;
  scaled.step_overhead_ms = 0.3;
  scaled.step_overhead_per_worker_ms = 0.1;
  scaled.step_overhead_per_task_ms = 0.002;
  const auto step = [&](const TrainingPlan& plan, double times) {
    return Calibration::ProbeRecord{
        "", {times * SimulatedMs(model, plan, scaled)}, {overhead(plan)}};
  };
  recorded.probe_steps = {step(probed.one, 1), step(probed.other, 1), step(probed.both, 2),
                          step(probed.zero, 1)};
  recorded.probe_steps[0].what = recorded.probe_steps[1].what = "one rank on one worker";
  recorded.probe_steps[2].what = "2 ranks at once";
  recorded.probe_steps[3].what = "2 ZeRO-3 ranks at once, 4 micro-batches";
  std::vector<std::string> said;
  ASSERT_OK_AND_ASSIGN(
      const Calibration refit,
      RefitCalibration(model, Base(), probed.request, recorded,
                       [&said](const std::string& line) { said.push_back(line); }));
  EXPECT_NEAR(refit.compute_scale, 1.2, 1e-9);
  EXPECT_NEAR(refit.step_overhead_ms, 0.3, 1e-9);
  EXPECT_NEAR(refit.step_overhead_per_worker_ms, 0.1, 1e-9);
  EXPECT_NEAR(refit.step_overhead_per_task_ms, 0.002, 1e-12);
  for (const TrainingPlan& plan : {probed.one, probed.both, probed.zero}) {
    const Result<StepGraph> planned = PlanTrainingStep(model, plan, CpuRegistry());
    ASSERT_OK(planned.status());
    EXPECT_NEAR(StepOverheadMs(refit, planned->graph), overhead(plan), 1e-9);
  }
  EXPECT_NEAR(SimulatedMs(model, probed.both, refit), 2 * SimulatedMs(model, probed.both, scaled),
              2e-3 * SimulatedMs(model, probed.both, scaled));
  EXPECT_THAT(said, ::testing::Contains(HasSubstr("a worker past the first")));
  // Refitting a refit changes nothing; the figures survive the cache file.
  ASSERT_OK_AND_ASSIGN(const Calibration again,
                       RefitCalibration(model, Base(), probed.request, refit));
  EXPECT_EQ(again.step_overhead_per_task_ms, refit.step_overhead_per_task_ms);
  EXPECT_EQ(again.step_overhead_per_worker_ms, refit.step_overhead_per_worker_ms);
  EXPECT_EQ(again.compute_scale, refit.compute_scale);
  const std::string path = ::testing::TempDir() + "/tessera_refit_timed.json";
  ASSERT_OK(SaveCalibration(path, "key", refit));
  ASSERT_OK_AND_ASSIGN(const Calibration loaded, LoadCalibration(path, "key"));
  EXPECT_EQ(loaded.step_overhead_per_task_ms, refit.step_overhead_per_task_ms);
  EXPECT_EQ(loaded.step_overhead_per_worker_ms, refit.step_overhead_per_worker_ms);
  ASSERT_EQ(loaded.probe_steps.size(), 4u);
  EXPECT_EQ(loaded.probe_steps[2].outside_ms, refit.probe_steps[2].outside_ms);
  std::filesystem::remove(path);
}

// With the collective link measured, one more probe: both workers ZeRO-3 ranks at once, at one
// row a micro-batch. Recorded at its step simulated with parameter gathers waiting 500 us, the
// refit finds that wait; a recording made before the probe existed refits without it, its
// gathers at what any collective of two waits.
TEST(PlanCalibrationTest, AZeroThreeProbeFitsWhatAParameterGatherWaits) {
  Probed probed;
  ASSERT_NO_FATAL_FAILURE(MeasureForARefit(probed));
  const ModelSpec& model = probed.model;
  Calibration recorded = WithTheLink(probed);
  const TrainingPlan& zero = probed.zero;
  Calibration gathering = recorded;
  gathering.links.gather_latency = {{2, 500}};
  const double zero_ms = SimulatedMs(model, zero, gathering);
  ASSERT_GT(zero_ms, SimulatedMs(model, zero, recorded));
  // The one rank's steps as simulated (scale 1, nothing a step), both ranks' too (no sharing).
  recorded.probe_steps = {{"one rank on one worker", {SimulatedMs(model, probed.one, recorded)}},
                          {"one rank on one worker", {SimulatedMs(model, probed.other, recorded)}},
                          {"2 ranks at once", {SimulatedMs(model, probed.both, recorded)}},
                          {"2 ZeRO-3 ranks at once, 4 micro-batches", {zero_ms}}};
  std::vector<std::string> said;
  ASSERT_OK_AND_ASSIGN(
      const Calibration refit,
      RefitCalibration(model, Base(), probed.request, recorded,
                       [&said](const std::string& line) { said.push_back(line); }));
  ASSERT_EQ(refit.links.gather_latency.size(), 1u);
  EXPECT_EQ(refit.links.gather_latency[0].members, 2);
  EXPECT_NEAR(refit.links.gather_latency[0].latency_us, 500, 1);
  EXPECT_NEAR(SimulatedMs(model, zero, refit), zero_ms, 1e-3 * zero_ms);
  EXPECT_THAT(said, ::testing::Contains(HasSubstr("a parameter gather of 2 waits")));
  const std::string path = ::testing::TempDir() + "/tessera_refit_gathers.json";
  ASSERT_OK(SaveCalibration(path, "key", refit));
  ASSERT_OK_AND_ASSIGN(const Calibration loaded, LoadCalibration(path, "key"));
  ASSERT_EQ(loaded.links.gather_latency.size(), 1u);
  EXPECT_EQ(loaded.links.gather_latency[0].latency_us, refit.links.gather_latency[0].latency_us);
  std::filesystem::remove(path);

  Calibration before_the_probe = recorded;
  before_the_probe.probe_steps.pop_back();
  ASSERT_OK_AND_ASSIGN(const Calibration without,
                       RefitCalibration(model, Base(), probed.request, before_the_probe));
  EXPECT_TRUE(without.links.gather_latency.empty());
  EXPECT_EQ(without.probe_steps.size(), 3u);
}

WorkerInfo Placed(uint64_t id, const std::string& host, const std::string& cpus) {
  WorkerInfo worker;
  worker.id = WorkerId(id);
  worker.hostname = host;
  worker.cpus = cpus;
  return worker;
}

// Which workers share cores: on one host, those whose CPU sets overlap (through others too),
// each group's share its cores over all; none when they all share one set or a set is unknown.
TEST(PlanCalibrationTest, WorkersShareTheCoresTheirSetsOverlapOn) {
  const std::vector<WorkerInfo> pinned = {Placed(2, "a", "0"), Placed(3, "a", "1"),
                                          Placed(4, "a", "0"), Placed(5, "a", "1")};
  const std::vector<WorkerId> ids = {WorkerId(2), WorkerId(3), WorkerId(4), WorkerId(5)};
  std::vector<CoreGroup> groups = CoreGroupsOf(pinned, ids);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].workers, (std::vector<WorkerId>{WorkerId(2), WorkerId(4)}));
  EXPECT_EQ(groups[1].workers, (std::vector<WorkerId>{WorkerId(3), WorkerId(5)}));
  EXPECT_EQ(groups[0].share, 0.5);
  // Consecutive workers on different cores, whatever order they joined in.
  EXPECT_EQ(InterleaveCoreGroups(ids, groups),
            (std::vector<WorkerId>{WorkerId(2), WorkerId(3), WorkerId(4), WorkerId(5)}));
  const std::vector<WorkerId> joined = {WorkerId(2), WorkerId(4), WorkerId(3), WorkerId(5)};
  EXPECT_EQ(InterleaveCoreGroups(joined, CoreGroupsOf(pinned, joined)),
            (std::vector<WorkerId>{WorkerId(2), WorkerId(3), WorkerId(4), WorkerId(5)}));
  EXPECT_EQ(InterleaveCoreGroups(joined, {}), joined);

  // Overlaps chain (0-1 with 1-2), other hosts never share; shares by cores: 3 of 5 and 2 of 5.
  groups = CoreGroupsOf({Placed(1, "a", "0-1"), Placed(2, "a", "1-2"), Placed(3, "b", "0-1")},
                        {WorkerId(1), WorkerId(2), WorkerId(3)});
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].workers, (std::vector<WorkerId>{WorkerId(1), WorkerId(2)}));
  EXPECT_DOUBLE_EQ(groups[0].share, 0.6);
  EXPECT_DOUBLE_EQ(groups[1].share, 0.4);

  // One set for all (the system moves them), an unknown set, a worker not there: no groups.
  EXPECT_TRUE(
      CoreGroupsOf({Placed(1, "a", "0-1"), Placed(2, "a", "0-1")}, {WorkerId(1), WorkerId(2)})
          .empty());
  EXPECT_TRUE(
      CoreGroupsOf({Placed(1, "a", "0"), Placed(2, "a", "")}, {WorkerId(1), WorkerId(2)}).empty());
  EXPECT_TRUE(CoreGroupsOf(pinned, {WorkerId(2), WorkerId(9)}).empty());
}

}  // namespace
}  // namespace tessera::testing
