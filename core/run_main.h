// A program's main body, run so that an exception escaping it (a bad flag value CLI11 throws, a
// failed allocation, a bug) ends the program with its message and status 1, not std::terminate:
//
//   int main(int argc, char** argv) {
//     return tessera::RunMain("train_gpt2", [&] { return Main(argc, argv); });
//   }
#pragma once

#include <cstdio>
#include <exception>

namespace tessera {

// Returns body()'s status; prints "<program>: error: <what>" and returns 1 when it throws.
template <typename Body>
int RunMain(const char* program, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
  } catch (...) {
    std::fprintf(stderr, "%s: error: an unknown exception\n", program);
  }
  return 1;
}

}  // namespace tessera
