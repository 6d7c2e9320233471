// Errors from C libraries and the kernel, one way: each names what was being done, the library's
// own words, and where in Tessera the call was (file:line), so an error from deep inside a
// transport says where it came from. The call site is recorded by default arguments
// (`const char* file = __builtin_FILE(), int line = __builtin_LINE()`, which GCC, Clang and nvcc
// evaluate at the call), so plain calls and the RETURN_IF_ERROR macros record it alike.
// (std::source_location::current() as a default argument names the declaration instead under
// Clang 15 and 16, which evaluate its consteval call where it is written: CWG 2631.)
//
//   SystemError("epoll_ctl")                          errno           core/checks.h
//   TESSERA_SYSCALL_RETURN_IF_ERROR(fd = ::socket(...), "socket")    (a result < 0: errno)
//   UcxError("endpoint create", status)               ucs_status_t    core/transport/ucx_common.h
//   TESSERA_UCX_RETURN_IF_ERROR(ucp_...(...), "what")
//   CudaError(error), TESSERA_CUDA_RETURN_IF_ERROR(cudaMalloc(...))   core/cuda_check.h
//
// Bugs are not errors: a broken invariant aborts with TESSERA_CHECK (core/status.h).
#pragma once

#include <cerrno>
#include <string>
#include <string_view>

#include "core/status.h"

namespace tessera {

// "file.cc:123" (the file's name without its directories).
std::string CallSite(const char* file, int line);

// `code` (Unavailable unless said otherwise): "<what> failed: <strerror(error)> (at file:line)".
Status SystemError(std::string_view what, int error = errno,
                   StatusCode code = StatusCode::kUnavailable, const char* file = __builtin_FILE(),
                   int line = __builtin_LINE());

// Returns SystemError(what) from the enclosing function when `call` yields a negative value.
#define TESSERA_SYSCALL_RETURN_IF_ERROR(call, what)             \
  do {                                                          \
    if ((call) < 0) return ::tessera::SystemError(what, errno); \
  } while (0)

}  // namespace tessera
