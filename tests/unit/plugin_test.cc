// Plugins (ops/plugin.h): examples/plugin's my_ops loaded into this process, its ops in every
// registry made after, its kernels checked against the formula and finite differences; the
// errors a user meets (no file, not a plugin, another ABI or layout, a missing symbol, another
// build of a loaded plugin, an op two plugins define, bytes that are not what they claim); and the
// registry's additions while other threads look kernels up.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "core/atomic_file.h"
#include "core/crypto.h"
#include "core/version.h"
#include "op_gradient_check.h"
#include "ops/cpu/cpu_kernels.h"
#include "ops/plugin.h"
#include "ops/standard_ops.h"
#include "test_util.h"

namespace tessera {
namespace {

const LoadedPlugin& MyOps() {
  Result<const LoadedPlugin*> plugin = LoadPlugin(TESSERA_MY_OPS_PLUGIN);
  TESSERA_CHECK(plugin.ok(), "{}", plugin.status().ToString());
  return **plugin;
}

std::string FixturePlugin(const char* name) {
  return std::string(TESSERA_TEST_PLUGIN_DIR) + "/lib" + name + ".so";
}

TEST(PluginTest, LoadsOnceAndNamesItself) {
  const LoadedPlugin& plugin = MyOps();
  EXPECT_EQ(plugin.name, "my_ops");
  EXPECT_EQ(plugin.tessera_version, TesseraVersion());
  EXPECT_EQ(plugin.sha256.size(), 64u);
  Result<std::string> bytes = ReadWholeFile(TESSERA_MY_OPS_PLUGIN);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(plugin.sha256, Sha256Hex(*bytes));
  EXPECT_EQ(plugin.library, *bytes);
  // Loading it again is the same plugin, also by another path to the same bytes.
  Result<const LoadedPlugin*> again = LoadPlugin(TESSERA_MY_OPS_PLUGIN);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, &plugin);
  EXPECT_EQ(FindLoadedPlugin(plugin.sha256), &plugin);
  const std::vector<const LoadedPlugin*> all = LoadedPlugins();
  EXPECT_EQ(std::count(all.begin(), all.end(), &plugin), 1);
}

TEST(PluginTest, ItsOpsAndKernelsAreInEveryRegistryMadeAfter) {
  MyOps();
  Result<OpRegistry> registry = MakeCpuOpRegistry();
  ASSERT_TRUE(registry.ok()) << registry.status().ToString();
  ASSERT_TRUE(registry->Find("softsign_forward").ok());
  EXPECT_TRUE(registry->Supports("softsign_forward", DeviceKind::kCpu));
  EXPECT_TRUE(registry->Supports("softsign_backward", DeviceKind::kCpu));
  EXPECT_FALSE(registry->Supports("softsign_forward", DeviceKind::kCuda));
  // Shape inference is the plugin's: a wrong dtype is refused, naming the op.
  Result<std::vector<TensorMeta>> wrong =
      registry->InferShapes("softsign_forward", {TensorMeta{Shape{2, 3}, DType::kI32}}, {});
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("softsign_forward"), std::string::npos);
}

TEST(PluginTest, TheKernelComputesSoftsign) {
  MyOps();
  Result<OpRegistry> registry = MakeCpuOpRegistry();
  ASSERT_TRUE(registry.ok());
  const std::vector<float> values = {-3.0f, -0.5f, 0.0f, 0.25f, 2.0f, 100.0f};
  Tensor x = *Tensor::FromVector(Shape{2, 3}, values);
  auto allocator = std::make_shared<AlignedHostAllocator>();
  Tensor out = *Tensor::Zeros(TensorMeta{Shape{2, 3}, DType::kF32}, allocator);
  Result<const KernelFn*> kernel = registry->FindKernel("softsign_forward", DeviceKind::kCpu);
  ASSERT_TRUE(kernel.ok());
  KernelContext context{allocator};
  context.registry = &*registry;
  ASSERT_TRUE((**kernel)(context, {x}, {out}, {}).ok());
  for (size_t i = 0; i < values.size(); ++i) {
    const double expected = values[i] / (1.0 + std::fabs(values[i]));
    EXPECT_NEAR(out.data<float>()[i], expected, 1e-6) << "element " << i;
  }
}

TEST(PluginTest, TheBackwardMatchesFiniteDifferences) {
  MyOps();
  testing::GradientCase c;
  c.forward = "softsign_forward";  // the backward, from the plugin's gradient rule
  c.inputs = {testing::RandomTensor(Shape{4, 8}, 3, 2.0f)};
  testing::ExpectGradientsMatchFiniteDifferences(c, 32);
}

TEST(PluginTest, AMissingFileIsNotFound) {
  Result<const LoadedPlugin*> plugin = LoadPlugin("/nonexistent/libnothing.so");
  ASSERT_FALSE(plugin.ok());
  EXPECT_EQ(plugin.status().code(), StatusCode::kNotFound);
  EXPECT_NE(plugin.status().message().find("/nonexistent/libnothing.so"), std::string::npos);
}

// A fresh, empty directory of this test process.
std::string FreshDir(const std::string& name) {
  std::string dir = testing::TempPath(name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(PluginTest, AFileThatIsNoLibraryIsRefused) {
  const std::string path = FreshDir("not_a_library") + "/notes.so";
  ASSERT_TRUE(WriteFileAtomically(path, "just text").ok());
  Result<const LoadedPlugin*> plugin = LoadPlugin(path);
  ASSERT_FALSE(plugin.ok());
  EXPECT_EQ(plugin.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plugin.status().message().find("cannot load plugin"), std::string::npos);
}

TEST(PluginTest, ALibraryWithoutTheEntryPointIsNoPlugin) {
  Result<const LoadedPlugin*> plugin = LoadPlugin(FixturePlugin("not_a_plugin"));
  ASSERT_FALSE(plugin.ok());
  EXPECT_EQ(plugin.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plugin.status().message().find("is not a Tessera plugin"), std::string::npos);
  EXPECT_NE(plugin.status().message().find("TESSERA_PLUGIN"), std::string::npos);
}

TEST(PluginTest, AnotherAbiVersionIsRefusedWithBothVersions) {
  Result<const LoadedPlugin*> plugin = LoadPlugin(FixturePlugin("bad_abi"));
  ASSERT_FALSE(plugin.ok());
  EXPECT_EQ(plugin.status().code(), StatusCode::kInfeasible);
  const std::string message = plugin.status().message();
  EXPECT_NE(message.find("plugin ABI version 999"), std::string::npos) << message;
  EXPECT_NE(message.find(fmt::format("version {}", kPluginAbiVersion)), std::string::npos)
      << message;
  EXPECT_NE(message.find("rebuild the plugin"), std::string::npos) << message;
}

TEST(PluginTest, OtherTypeLayoutsAreRefused) {
  Result<const LoadedPlugin*> plugin = LoadPlugin(FixturePlugin("bad_layout"));
  ASSERT_FALSE(plugin.ok());
  EXPECT_EQ(plugin.status().code(), StatusCode::kInfeasible);
  EXPECT_NE(plugin.status().message().find("other type layouts"), std::string::npos);
  EXPECT_NE(plugin.status().message().find("other_compiler"), std::string::npos);
}

TEST(PluginTest, ASymbolTheProcessLacksIsReportedAtLoad) {
  Result<const LoadedPlugin*> plugin = LoadPlugin(FixturePlugin("missing_symbol"));
  ASSERT_FALSE(plugin.ok());
  EXPECT_EQ(plugin.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(plugin.status().message().find("tessera_function_nobody_defines"), std::string::npos)
      << plugin.status().message();
}

TEST(PluginTest, AnotherBuildOfALoadedPluginIsRefused) {
  const LoadedPlugin& loaded = MyOps();
  Result<const LoadedPlugin*> rebuild = LoadPlugin(FixturePlugin("my_ops_rebuild"));
  ASSERT_FALSE(rebuild.ok());
  EXPECT_EQ(rebuild.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(rebuild.status().message().find(loaded.sha256.substr(0, 12)), std::string::npos);
  EXPECT_NE(rebuild.status().message().find("tessera down and up"), std::string::npos);
}

TEST(PluginTest, AnOpTwoPluginsDefineIsRefusedNamingBoth) {
  // In a child process: the clashing plugin stays loaded, and every registry made after it
  // would fail. "threadsafe": the child starts afresh (this process may run threads by now).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        MyOps();
        Result<const LoadedPlugin*> clashing = LoadPlugin(FixturePlugin("clashing_ops"));
        TESSERA_CHECK(clashing.ok(), "{}", clashing.status().ToString());
        Result<OpRegistry> registry = MakeCpuOpRegistry();
        TESSERA_CHECK(!registry.ok(), "the clash went unnoticed");
        std::fprintf(stderr, "%s\n", registry.status().ToString().c_str());
        std::exit(registry.status().code() == StatusCode::kAlreadyExists ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "plugin 'clashing_ops'.*softsign_forward.*already registered");
}

TEST(PluginTest, BytesAreLoadedByContentIntoTheDirectory) {
  const LoadedPlugin& plugin = MyOps();
  const std::string dir = FreshDir("plugin_bytes");
  // Already loaded (a worker sent the same plugin twice): the same plugin, nothing written.
  Result<const LoadedPlugin*> same =
      LoadPluginBytes(plugin.name, plugin.sha256, plugin.library, dir);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(*same, &plugin);
  // Bytes that are not what they claim are refused before anything is written.
  Result<const LoadedPlugin*> lying =
      LoadPluginBytes("my_ops", std::string(64, 'a'), plugin.library, dir);
  ASSERT_FALSE(lying.ok());
  EXPECT_EQ(lying.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  // New bytes: written under the directory, named by their digest, and loaded from there.
  Result<std::string> bytes = ReadWholeFile(FixturePlugin("not_a_plugin"));
  ASSERT_TRUE(bytes.ok());
  const std::string digest = Sha256Hex(*bytes);
  Result<const LoadedPlugin*> refused = LoadPluginBytes("odd", digest, *bytes, dir);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(dir + "/" + digest.substr(0, 16) + "-odd.so"),
            std::string::npos)
      << refused.status().ToString();
}

TEST(PluginTest, APluginAddedLaterReachesAnExistingRegistry) {
  // A worker's registry is made before the scheduler sends a plugin: AddPluginTo adds it (here
  // to an empty registry, which no earlier load reached).
  OpRegistry registry;
  const LoadedPlugin& plugin = MyOps();
  ASSERT_FALSE(registry.Find("softsign_forward").ok());
  Status added = AddPluginTo(plugin, registry, {DeviceKind::kCpu});
  ASSERT_TRUE(added.ok()) << added.ToString();
  EXPECT_TRUE(registry.Supports("softsign_forward", DeviceKind::kCpu));
  EXPECT_TRUE(registry.Supports("softsign_backward", DeviceKind::kCpu));
  // Twice is an error naming the plugin (the worker's loader adds each plugin once).
  Status twice = AddPluginTo(plugin, registry, {DeviceKind::kCpu});
  EXPECT_EQ(twice.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(twice.message().find("plugin 'my_ops'"), std::string::npos);
}

TEST(PluginTest, LookupsRunWhileOpsAreAdded) {
  OpRegistry registry;
  ASSERT_TRUE(RegisterStandardOps(registry).ok());
  ASSERT_TRUE(RegisterCpuKernels(registry).ok());
  // The writer starts only once every reader is looking kernels up, so lookups and additions
  // overlap however the threads are scheduled (on a busy machine the writer could otherwise finish
  // before a reader first runs).
  constexpr int kReaders = 3;
  constexpr int kAdded = 200;
  std::atomic<bool> stop{false};
  std::atomic<int> readers_started{0};
  std::atomic<int64_t> missed_standard_kernel{0};
  std::vector<std::thread> readers;
  readers.reserve(kReaders);
  for (int t = 0; t < kReaders; ++t) {
    readers.emplace_back([&] {
      bool started = false;
      while (!stop) {
        if (!registry.FindKernel("gelu_forward", DeviceKind::kCpu).ok()) ++missed_standard_kernel;
        (void)registry.Supports("added_0", DeviceKind::kCpu);
        if (!started) {
          started = true;
          ++readers_started;
        }
      }
    });
  }
  while (readers_started.load() < kReaders) std::this_thread::yield();
  const OpDef template_def = **registry.Find("gelu_forward");
  int added = 0;
  for (; added < kAdded; ++added) {
    OpDef def = template_def;
    def.name = fmt::format("added_{}", added);
    def.gradient.reset();
    if (!registry.AddOp(std::move(def)).ok()) break;
    if (!registry
             .AddKernel(fmt::format("added_{}", added), DeviceKind::kCpu,
                        [](const KernelContext&, const std::vector<Tensor>&,
                           const std::vector<Tensor>&, const Attrs&) { return Status::Ok(); })
             .ok()) {
      break;
    }
  }
  stop = true;
  for (std::thread& reader : readers) reader.join();
  EXPECT_EQ(added, kAdded);
  EXPECT_EQ(missed_standard_kernel.load(), 0);
  EXPECT_TRUE(registry.Supports(fmt::format("added_{}", kAdded - 1), DeviceKind::kCpu));
  const std::vector<std::string> names = registry.OpNames();
  EXPECT_EQ(std::count_if(names.begin(), names.end(),
                          [](const std::string& name) { return name.starts_with("added_"); }),
            kAdded);
}

}  // namespace
}  // namespace tessera
