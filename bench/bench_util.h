// Helpers the benchmarks share: running the side-by-side peer (a Python script) and reading
// its figures, medians, and giving up with the reason.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "core/run_main.h"
#include "core/statistics.h"
#include "core/status.h"

namespace tessera::bench {

// Benchmarks run their main through core/run_main.h's RunMain.
using ::tessera::RunMain;

// Runs a shell command and returns its standard output (empty when it fails).
inline std::string Capture(const std::string& command) {
  std::string output;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return output;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  if (::pclose(pipe) != 0) return "";
  return output;
}

// The number after `"name": ` in a JSON line (the first one in `text`), or -1 when absent.
inline double JsonNumber(const std::string& text, const std::string& name) {
  const std::string key = "\"" + name + "\":";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::atof(text.c_str() + at + key.size());
}

using ::tessera::Median;  // core/statistics.h

// Prints "<program>: <what>: <status>" and exits 1: a benchmark that cannot run says why.
[[noreturn]] inline void Die(const char* program, const Status& status, const std::string& what) {
  std::fprintf(stderr, "%s: %s: %s\n", program, what.c_str(), status.ToString().c_str());
  std::exit(1);
}

// The value of `result`, or Die.
template <typename T>
T Check(const char* program, Result<T> result, const std::string& what) {
  if (!result.ok()) Die(program, result.status(), what);
  return std::move(result).value();
}

}  // namespace tessera::bench
