// What UCX this process has, for `tessera doctor`: its version, and whether a worker opens with
// the data plane's transport settings (UCX_TLS, if set, else UCX's choice without CMA).
//
// Thread safety: any thread; it opens and closes a UCX context of its own.
#pragma once

#include <string>

namespace tessera {

// "UCX 1.13.1; a worker opens (transports: UCX's choice but cma)", or why it does not.
std::string DescribeUcx();

}  // namespace tessera
