#include "core/rpc/io_loop.h"

#include "core/idle_spin.h"

namespace tessera::rpc {

void RunIoLoop(asio::io_context& io, std::chrono::microseconds spin) {
  if (spin.count() <= 0) {
    io.run();
    return;
  }
  IdleSpinner spinner(spin);
  while (!io.stopped()) {
    // poll runs every ready handler (the reactor with a zero timeout); it stops the context
    // when it is out of work, as run would return.
    if (spinner.Spin([&io] { return io.poll() > 0 || io.stopped(); })) continue;
    if (io.run_one() == 0) return;  // blocks until a handler ran; 0: stopped or out of work
    spinner.Woke();
  }
}

}  // namespace tessera::rpc
