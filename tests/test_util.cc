#include "test_util.h"

#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include <tbb/global_control.h>

#include <fmt/format.h>

#include "core/collective_task.h"
#include "ops/cpu/cpu_kernels.h"

namespace tessera::testing {

#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer cannot see TBB's own synchronisation (Debian's libtbb is not instrumented): with
// more than one TBB thread every task hand-off looks like a race. One TBB thread leaves the
// runtime's own threads (data plane, collective engine, connections, callers of Provide and
// Cancel) for TSan to check, which is what scripts/sanitize.sh thread is for.
const tbb::global_control kOneTbbThreadUnderTsan(tbb::global_control::max_allowed_parallelism, 1);
#endif

std::shared_ptr<Allocator> TestAllocator() {
  static auto allocator = std::make_shared<AlignedHostAllocator>();
  return allocator;
}

const OpRegistry& CpuRegistry() {
  static const OpRegistry registry = [] {
    Result<OpRegistry> built = MakeCpuOpRegistry();
    TESSERA_CHECK(built.ok(), "{}", built.status().ToString());
    return std::move(built).value();
  }();
  return registry;
}

namespace {
Tensor Allocate(const TensorMeta& meta) {
  Result<Tensor> tensor = Tensor::Zeros(meta, TestAllocator());
  TESSERA_CHECK(tensor.ok(), "{}", tensor.status().ToString());
  return *std::move(tensor);
}
}  // namespace

Graph ChannelOrderGraph() {
  Graph graph;
  const TensorMeta one{Shape{1}, DType::kF32, Device::Cpu()};
  const ObjectId in = graph.AddObject("slow_in", one, ObjectRole::kInput);
  const ObjectId mid = graph.AddObject("slow_mid", one, ObjectRole::kActivation);
  const ObjectId late = graph.AddObject("slow_out", one, ObjectRole::kActivation);
  for (const auto& [name, from, to] :
       {std::tuple{"slow.a", in, mid}, std::tuple{"slow.b", mid, late}}) {
    TaskSpec slow;
    slow.name = name;
    slow.op = "probe";
    slow.inputs = {from};
    slow.outputs = {to};
    slow.pinned_worker = WorkerId(2);
    graph.AddTask(std::move(slow));
  }
  for (const int64_t collective : {1, 2, 3}) {
    for (int r = 0; r < 2; ++r) {
      const ObjectId shard = graph.AddObject(fmt::format("shard{}.{}", collective, r),
                                             TensorMeta{Shape{10}, DType::kF32, Device::Cpu()},
                                             ObjectRole::kParameter);
      const ObjectId full = graph.AddObject(fmt::format("full{}.{}", collective, r),
                                            TensorMeta{Shape{20}, DType::kF32, Device::Cpu()},
                                            ObjectRole::kGatheredParameter);
      TaskSpec gather;
      gather.name = fmt::format("gather{}.{}", collective, r);
      gather.op = "all_gather";
      gather.inputs = {shard};
      if (collective == 1 && r == 1) gather.inputs.push_back(late);
      gather.outputs = {full};
      gather.pinned_worker = WorkerId(static_cast<uint64_t>(r + 1));
      gather.attrs.Set(kCollectiveAttr, collective);
      gather.attrs.Set(kRankAttr, int64_t{r});
      gather.attrs.Set(kGroupSizeAttr, int64_t{2});
      if (collective == 3) gather.attrs.Set(kChannelAttr, int64_t{kGatherChannel});
      graph.AddTask(std::move(gather));
      graph.MarkOutput(full);
    }
  }
  return graph;
}

Tensor FloatTensor(const Shape& shape, const std::vector<float>& values) {
  Tensor t = Allocate(TensorMeta{shape, DType::kF32, Device::Cpu()});
  TESSERA_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  if (!values.empty()) {  // an empty tensor (a layer without parameters): nothing to copy
    std::memcpy(t.raw_data(), values.data(), values.size() * sizeof(float));
  }
  return t;
}

Tensor IntTensor(const Shape& shape, const std::vector<int32_t>& values) {
  Tensor t = Allocate(TensorMeta{shape, DType::kI32, Device::Cpu()});
  TESSERA_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  if (!values.empty()) std::memcpy(t.raw_data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

Tensor RandomTensor(const Shape& shape, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& v : values) v = dist(rng);
  return FloatTensor(shape, values);
}

Tensor RandomTokens(const Shape& shape, int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> values(static_cast<size_t>(shape.numel()));
  for (int32_t& v : values) v = dist(rng);
  return IntTensor(shape, values);
}

Tensor ScalarTensor(float value) { return FloatTensor(Shape{}, {value}); }

Tensor Int64Scalar(int64_t value) {
  Tensor t = Allocate(TensorMeta{Shape{}, DType::kI64, Device::Cpu()});
  *t.data<int64_t>() = value;
  return t;
}

std::vector<float> ToVector(const Tensor& tensor) {
  const float* data = tensor.data<float>();
  return std::vector<float>(data, data + tensor.numel());
}

Result<std::vector<Tensor>> RunKernel(const std::string& op, const std::vector<Tensor>& inputs,
                                      const Attrs& attrs) {
  const OpRegistry& registry = CpuRegistry();
  std::vector<TensorMeta> metas;
  metas.reserve(inputs.size());
  for (const Tensor& t : inputs) metas.push_back(t.meta());
  TESSERA_ASSIGN_OR_RETURN(std::vector<TensorMeta> out_metas,
                           registry.InferShapes(op, metas, attrs));
  TESSERA_ASSIGN_OR_RETURN(const OpDef* def, registry.Find(op));
  std::vector<Tensor> outputs;
  outputs.reserve(out_metas.size());
  for (const TensorMeta& meta : out_metas) outputs.push_back(Allocate(meta));
  for (const auto& [in, out] : def->in_place) {
    std::memcpy(outputs[out].raw_data(), inputs[in].raw_data(),
                static_cast<size_t>(inputs[in].bytes()));
  }
  TESSERA_ASSIGN_OR_RETURN(const KernelFn* kernel, registry.FindKernel(op, DeviceKind::kCpu));
  // Its scratch counted apart, against what the op declares (OpDef::workspace, which the memory
  // model counts).
  auto scratch = std::make_shared<CountingAllocator>(TestAllocator());
  KernelContext context{scratch, 1, &registry};  // split every GEMM: the split path
  TESSERA_RETURN_IF_ERROR((*kernel)(context, inputs, outputs, attrs));
  TESSERA_ASSIGN_OR_RETURN(const int64_t declared, registry.Workspace(op, metas, attrs));
  if (scratch->stats().peak_bytes != declared) {
    return Internal(
        "op {}: its CPU kernel held {} bytes of scratch at once, but the op declares {}", op,
        scratch->stats().peak_bytes, declared);
  }
  return outputs;
}

double ScaledMaxError(const std::vector<float>& actual, const std::vector<float>& expected,
                      double floor) {
  TESSERA_CHECK(actual.size() == expected.size());
  double max_error = 0, max_reference = floor;
  for (size_t i = 0; i < actual.size(); ++i) {
    max_error = std::max(max_error, std::abs(static_cast<double>(actual[i]) - expected[i]));
    max_reference = std::max(max_reference, std::abs(static_cast<double>(expected[i])));
  }
  return max_error / max_reference;
}

std::string ReadFileText(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

Result<std::map<std::string, ReferenceTensor>> ReadReferenceFile(const std::string& path) {
  if (!std::ifstream(path)) return NotFound("cannot open reference file '{}'", path);
  const std::string bytes = ReadFileText(path);
  size_t position = 0;
  auto read = [&](void* out, size_t n) -> Status {
    if (position + n > bytes.size()) return DataLoss("reference file '{}' is truncated", path);
    std::memcpy(out, bytes.data() + position, n);
    position += n;
    return Status::Ok();
  };
  char magic[4];
  uint32_t version = 0, count = 0;
  TESSERA_RETURN_IF_ERROR(read(magic, 4));
  if (std::memcmp(magic, "TSRF", 4) != 0) return DataLoss("'{}' is not a TSRF file", path);
  TESSERA_RETURN_IF_ERROR(read(&version, 4));
  TESSERA_RETURN_IF_ERROR(read(&count, 4));
  std::map<std::string, ReferenceTensor> tensors;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t name_length = 0;
    TESSERA_RETURN_IF_ERROR(read(&name_length, 4));
    std::string name(name_length, '\0');
    TESSERA_RETURN_IF_ERROR(read(name.data(), name_length));
    uint8_t dtype = 0, rank = 0;
    TESSERA_RETURN_IF_ERROR(read(&dtype, 1));
    TESSERA_RETURN_IF_ERROR(read(&rank, 1));
    std::vector<int64_t> dims(rank);
    TESSERA_RETURN_IF_ERROR(read(dims.data(), rank * sizeof(int64_t)));
    ReferenceTensor tensor;
    tensor.shape = Shape(dims);
    const size_t n = static_cast<size_t>(tensor.shape.numel());
    if (dtype == 0) {
      tensor.floats.resize(n);
      TESSERA_RETURN_IF_ERROR(read(tensor.floats.data(), n * sizeof(float)));
    } else {
      tensor.ints.resize(n);
      TESSERA_RETURN_IF_ERROR(read(tensor.ints.data(), n * sizeof(int32_t)));
    }
    tensors.emplace(std::move(name), std::move(tensor));
  }
  return tensors;
}

std::string SourcePath(const std::string& relative) {
  return std::string(TESSERA_SOURCE_DIR) + "/" + relative;
}

std::string BinaryPath(const std::string& name) {
  // Tests run from a staged copy elsewhere (scripts/gpu_check.sh) are told where the binaries are.
  const char* staged = std::getenv("TESSERA_TEST_BIN_DIR");
  return std::string(staged != nullptr && *staged != '\0' ? staged : TESSERA_BIN_DIR) + "/" + name;
}

ProcessResult RunBinary(const std::string& binary, const std::string& arguments) {
  const std::string command = BinaryPath(binary) + " " + arguments + " 2>&1";
  ProcessResult result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

BoundedRun RunBinaryWithin(const std::string& binary, const std::string& arguments,
                           std::chrono::milliseconds deadline, const std::string& environment) {
  const std::string command = environment + (environment.empty() ? "" : " ") + "exec " +
                              BinaryPath(binary) + " " + arguments + " 2>&1";
  BoundedRun result;
  int out[2];
  if (::pipe(out) != 0) return result;
  const pid_t pid = ::fork();
  if (pid < 0) return result;
  if (pid == 0) {
    ::setpgid(0, 0);  // its own group: the deadline kills whatever it started too
    ::dup2(out[1], STDOUT_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // as the child does: whichever runs first
  ::close(out[1]);
  const auto until = std::chrono::steady_clock::now() + deadline;
  char buffer[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      result.timed_out = true;
      ::kill(-pid, SIGKILL);
      break;
    }
    pollfd readable{out[0], POLLIN, 0};
    if (::poll(&readable, 1, static_cast<int>(std::min<int64_t>(left.count(), 100))) <= 0) {
      continue;
    }
    const ssize_t n = ::read(out[0], buffer, sizeof(buffer));
    if (n <= 0) break;  // every writer closed it: the program (and what it started) ended
    result.output.append(buffer, static_cast<size_t>(n));
  }
  ::close(out[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.exited = WIFEXITED(status);
  result.exit_code = result.exited ? WEXITSTATUS(status) : -1;
  result.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  return result;
}

bool Eventually(const std::function<bool()>& condition, std::chrono::milliseconds deadline,
                std::chrono::milliseconds poll) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (true) {
    if (condition()) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(poll);
  }
}

int AffordableWithDescriptors(int wanted, int descriptors_each, int reserve, const char* what) {
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
    ::getrlimit(RLIMIT_NOFILE, &limit);
  }
  const auto descriptors = static_cast<int>(std::min<rlim_t>(limit.rlim_cur, 1 << 20));
  const int affordable = std::max(16, (descriptors - reserve) / std::max(1, descriptors_each));
  if (affordable < wanted) {
    std::printf("the descriptor limit (%d) affords %d %s, not %d\n", descriptors, affordable, what,
                wanted);
  }
  return std::min(wanted, affordable);
}

bool ProcessGone(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const size_t close = line.rfind(')');
  return close != std::string::npos && line.size() > close + 2 && line[close + 2] == 'Z';
}

std::string TempPath(const std::string& name) {
  return fmt::format("{}/tessera_{}_{}", ::testing::TempDir(), ::getpid(), name);
}

std::vector<int> LiveChildren(int parent) {
  std::vector<int> children;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const size_t close = line.rfind(')');
    if (close == std::string::npos || line.size() < close + 2) continue;
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent && state != 'Z') children.push_back(std::stoi(name));
  }
  return children;
}

std::string CommandLine(int pid) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::replace(text.begin(), text.end(), '\0', ' ');
  return text;
}

}  // namespace tessera::testing
