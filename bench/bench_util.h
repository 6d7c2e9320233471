// Helpers the benchmarks share: running the side-by-side peer (a Python script) and reading
// its figures.
#pragma once

#include <cstdio>
#include <string>

namespace tessera::bench {

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

}  // namespace tessera::bench
