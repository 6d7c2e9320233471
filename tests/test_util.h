// Helpers shared by Tessera's tests: random tensors, running one kernel the way the executor
// would, and reading the PyTorch reference file (tests/reference/make_gpt2_reference.py).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/attrs.h"
#include "core/graph.h"
#include "core/status.h"
#include "core/tensor.h"
#include "ops/op_registry.h"

namespace tessera::testing {

// Polls `condition` every `poll` until it holds (true) or `deadline` passes (false). For what
// arrives asynchronously (a heartbeat's figures, a process's exit): never a fixed sleep.
bool Eventually(const std::function<bool()>& condition,
                std::chrono::milliseconds deadline = std::chrono::seconds(10),
                std::chrono::milliseconds poll = std::chrono::milliseconds(20));

// A path for `name` in the temporary directory that no other test process uses (test binaries
// run concurrently, one per test and once more per OpenBLAS kernel family).
std::string TempPath(const std::string& name);

// The live (not zombie) children of process `parent`.
std::vector<int> LiveChildren(int parent);
// Process `pid`'s command line, its arguments separated by spaces ("" when it is gone).
std::string CommandLine(int pid);

// How many of `wanted` things that each hold `descriptors_each` open descriptors this process
// can afford, `reserve` descriptors kept free, after raising its soft descriptor limit to the hard
// one (processes it starts later inherit that). Prints the limit when it affords fewer.
int AffordableWithDescriptors(int wanted, int descriptors_each, int reserve, const char* what);

// Whether process `pid` has exited (gone from /proc, or a zombie nobody reaped yet).
bool ProcessGone(int pid);

// gtest assertion helpers for Status/Result.
#define ASSERT_OK(expr)                                                \
  do {                                                                 \
    const ::tessera::Status& assert_ok_status = (expr);                \
    ASSERT_TRUE(assert_ok_status.ok()) << assert_ok_status.ToString(); \
  } while (0)
#define EXPECT_OK(expr)                                                \
  do {                                                                 \
    const ::tessera::Status& expect_ok_status = (expr);                \
    EXPECT_TRUE(expect_ok_status.ok()) << expect_ok_status.ToString(); \
  } while (0)
// Unwraps a Result or fails the test.
// NOLINTBEGIN(bugprone-macro-parentheses): `result` is a name being declared and `lhs` a
// declaration (`auto x`), which parentheses would break.
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(TESSERA_CONCAT(test_result_, __COUNTER__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(result, lhs, expr)      \
  auto result = (expr);                                   \
  ASSERT_TRUE(result.ok()) << result.status().ToString(); \
  lhs = std::move(result).value()
// NOLINTEND(bugprone-macro-parentheses)

std::shared_ptr<Allocator> TestAllocator();
// The registry with every standard op and its CPU kernel (built once per process).
const OpRegistry& CpuRegistry();

// A graph whose collectives' channel order matters: worker 2 runs "slow.a" then "slow.b";
// all-gathers 1, 2 (channel 0) and 3 (the gather channel) over workers 1 and 2, members
// "gather<c>.<rank>", each gathering a 10-float shard into a 20-float output (a graph output).
// Collective 1 comes first in the graph, so first on channel 0, but its member on worker 2 waits
// for slow.b; 2 and 3 are ready at once.
Graph ChannelOrderGraph();

Tensor FloatTensor(const Shape& shape, const std::vector<float>& values);
Tensor IntTensor(const Shape& shape, const std::vector<int32_t>& values);
// Uniform in [-scale, scale), deterministic in seed.
Tensor RandomTensor(const Shape& shape, uint64_t seed, float scale = 1.0f);
Tensor RandomTokens(const Shape& shape, int32_t vocab, uint64_t seed);
Tensor ScalarTensor(float value);
Tensor Int64Scalar(int64_t value);
std::vector<float> ToVector(const Tensor& tensor);

// Infers the op's outputs, allocates them (in-place outputs start as copies of their inputs,
// as the executor guarantees), and runs the CPU kernel. Internal when the scratch the kernel held
// at most differs from what the op declares (OpRegistry::Workspace).
Result<std::vector<Tensor>> RunKernel(const std::string& op, const std::vector<Tensor>& inputs,
                                      const Attrs& attrs = {});

// max |a - b| / max(max |b|, floor): the error relative to the reference tensor's scale.
double ScaledMaxError(const std::vector<float>& actual, const std::vector<float>& expected,
                      double floor = 1e-12);

// The TSRF file written by tests/reference/make_gpt2_reference.py.
struct ReferenceTensor {
  Shape shape;
  std::vector<float> floats;  // for f32 tensors
  std::vector<int32_t> ints;  // for i32 tensors
};
Result<std::map<std::string, ReferenceTensor>> ReadReferenceFile(const std::string& path);

// Absolute paths: the source tree and build/bin ($TESSERA_TEST_BIN_DIR instead where set).
std::string SourcePath(const std::string& relative);
std::string BinaryPath(const std::string& name);

// Runs build/bin/<binary> with `arguments` (a shell command line) and returns its exit code
// (-1 when it did not exit normally or could not start) and its stdout and stderr together.
struct ProcessResult {
  int exit_code = -1;
  std::string output;
};
ProcessResult RunBinary(const std::string& binary, const std::string& arguments);

// Runs build/bin/<binary> as RunBinary does, with `environment` ("NAME=value ...", may be empty)
// added to its environment, in a process group of its own that is killed (SIGKILL) when it runs
// past `deadline`: a hang ends the call and shows in the result instead of hanging the test.
struct BoundedRun {
  bool exited = false;  // exited normally (with exit_code)
  int exit_code = -1;
  int signal = 0;          // the signal that ended it, when it did not exit
  bool timed_out = false;  // killed at the deadline
  std::string output;      // stdout and stderr together
};
BoundedRun RunBinaryWithin(const std::string& binary, const std::string& arguments,
                           std::chrono::milliseconds deadline, const std::string& environment = "");

// The whole contents of a file ("" when it cannot be read: tests assert on what they expect).
std::string ReadFileText(const std::string& path);

}  // namespace tessera::testing
