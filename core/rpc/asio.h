// Includes Boost.Asio the way this project needs it (one place, so the workaround lives once):
// Boost 1.74's Asio under GCC 12 in C++20 uses std::exchange without including <utility>.
#pragma once

#include <utility>

#include <boost/asio.hpp>

namespace tessera::rpc {
namespace asio = boost::asio;
using GenericSocket = asio::generic::stream_protocol::socket;
}  // namespace tessera::rpc
