// Includes Boost.Asio the way this project needs it (one place, so the workaround lives once):
// Boost 1.74's Asio under GCC 12 in C++20 uses std::exchange without including <utility>.
// Only the parts the runtime uses, not <boost/asio.hpp>, which parses in ~0.6 s more per
// translation unit (GCC 12, -O2): a few seconds of every build's critical path.
#pragma once

#include <utility>

#include <boost/asio/buffer.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/socket_base.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

namespace tessera::rpc {
namespace asio = boost::asio;
using GenericSocket = asio::generic::stream_protocol::socket;
}  // namespace tessera::rpc
