// Helpers the benchmarks share: running the side-by-side peer (a Python script) and reading
// its figures.
#pragma once

#include <cstdio>
#include <cstdlib>
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

// The number after `"name": ` in a JSON line (the first one in `text`), or -1 when absent.
inline double JsonNumber(const std::string& text, const std::string& name) {
  const std::string key = "\"" + name + "\":";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::atof(text.c_str() + at + key.size());
}

}  // namespace tessera::bench
