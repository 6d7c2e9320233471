// What the fuzz targets share: quiet logging, and writing a target's seed corpus.
//
// Every target (fuzz/*_fuzzer.cc) defines its seeds in code, next to the format they exercise:
// run with TESSERA_FUZZ_WRITE_SEEDS=<dir>, a target writes them there and exits
// (scripts/fuzz.sh --seeds regenerates fuzz/corpus/ this way).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "core/logging.h"

namespace tessera::fuzz {

using Seed = std::vector<uint8_t>;

inline Seed SeedOf(std::string_view text) { return Seed(text.begin(), text.end()); }

// Silences every logger (a message per execution would dominate the time), then, when
// TESSERA_FUZZ_WRITE_SEEDS names a directory, writes `seeds()` there as seed-000, seed-001, ...
// and exits.
template <typename SeedsFn>
void InitializeTarget(SeedsFn seeds) {
  (void)SetLogLevel("off");
  const char* dir = std::getenv("TESSERA_FUZZ_WRITE_SEEDS");
  if (dir == nullptr || *dir == '\0') return;
  int index = 0;
  for (const Seed& seed : seeds()) {
    char name[32];
    std::snprintf(name, sizeof(name), "/seed-%03d", index++);
    const std::string path = std::string(dir) + name;
    std::FILE* file = std::fopen(path.c_str(), "wb");
    if (file == nullptr || std::fwrite(seed.data(), 1, seed.size(), file) != seed.size()) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      std::exit(1);
    }
    std::fclose(file);
  }
  std::fprintf(stderr, "wrote %d seeds to %s\n", index, dir);
  std::exit(0);
}

}  // namespace tessera::fuzz
