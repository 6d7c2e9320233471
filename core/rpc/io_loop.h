// RunIoLoop: an io thread's loop, io_context::run with idle spinning (core/idle_spin.h).
//
// When no handler is ready the thread keeps polling the reactor, yielding between polls, for up
// to `spin` (an IdleSpinner's allowance) before it blocks in it, so a message or a posted
// handler that comes soon after the last one is taken without a wake-up. With `spin` 0 it is
// io_context::run. Returns, like run,
// when the context is stopped or out of work.
#pragma once

#include <chrono>

#include "core/rpc/asio.h"

namespace tessera::rpc {

void RunIoLoop(asio::io_context& io, std::chrono::microseconds spin);

}  // namespace tessera::rpc
