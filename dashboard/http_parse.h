// Reading an HTTP request the way the dashboard's server does: Boost.Beast's parser with the
// server's limits, then the few fields the handler looks at (http_handler.h's HttpRequest).
//
// The server (http_server.cc) parses from its socket and converts with PlainRequest;
// ParseHttpRequest does the same from bytes in memory, for tests and the HTTP fuzzer (fuzz/).
//
// Thread safety: functions of their arguments only.
#pragma once

#include <cstdint>
#include <string_view>
// Boost 1.74's Asio under GCC 12 in C++20 uses std::exchange without including <utility>.
#include <utility>

#include <boost/beast/http.hpp>

#include "core/status.h"
#include "dashboard/http_handler.h"

namespace tessera::dashboard {

// The request as the handler sees it: method, target, Cookie and Authorization.
HttpRequest PlainRequest(const boost::beast::http::request<boost::beast::http::string_body>& in);

// One whole request from `bytes` (header within `header_limit` bytes, body within
// `body_limit`). InvalidArgument with Beast's reason for a malformed request, ResourceExhausted
// for one over a limit (the server answers 400 and 413), InvalidArgument too when the bytes end
// before the request does.
Result<HttpRequest> ParseHttpRequest(std::string_view bytes, uint32_t header_limit,
                                     uint32_t body_limit);

}  // namespace tessera::dashboard
