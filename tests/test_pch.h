// The headers most test programs include, precompiled once for all of them (tests/CMakeLists.txt,
// option TESSERA_TEST_PCH): GoogleTest and gMock, the standard library, and the project headers
// the most test sources read (a trainer, a cluster, the GPT-2 and U-Net models, collectives, step
// graphs). Parsing them was about 2.4 s of a test source's 6 s; each of ~120 sources now loads the
// precompiled form instead. Every test source still includes what it uses: this header only makes
// that cheaper, so a test builds the same with the option off (or under Clang, without a PCH).
//
// Keep it to headers that do not read a macro a test program defines (a PCH built without the
// macro is then invalid for it; -Winvalid-pch makes that an error under TESSERA_WERROR).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "client/cluster.h"
#include "client/graph_backend.h"
#include "core/collective_task.h"
#include "model/gpt2.h"
#include "model/unet3d.h"
#include "planner/step_graph.h"
#include "test_util.h"
#include "training/trainer.h"
