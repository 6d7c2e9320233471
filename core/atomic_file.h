// Small files: atomic writes (the content goes to a temporary file beside the target, is
// fsynced, and is renamed over the target, so a reader or a crash sees the old file or the new
// one, never a partial one), and reading a small text file such as a token or an address.
#pragma once

#include <string>
#include <string_view>

#include "core/status.h"

namespace tessera {

// Unavailable/DataLoss naming the path and the system error otherwise; the target is untouched
// on failure. `mode` is the new file's permission bits (0600 for secrets such as tokens).
Status WriteFileAtomically(const std::string& path, std::string_view contents, int mode = 0644);

// The whole file, bytes as they are. NotFound naming `what` ("data file", "checkpoint file"),
// the path and the system error when it cannot be opened; InvalidArgument when it is not a
// regular file (a directory, a device such as /dev/zero, a pipe); ResourceExhausted when it is
// larger than the machine's memory; DataLoss when reading it fails.
Result<std::string> ReadWholeFile(const std::string& path, std::string_view what = "file");

// The whole file without trailing whitespace. NotFound naming the path and the system error.
Result<std::string> ReadFileTrimmed(const std::string& path);

}  // namespace tessera
