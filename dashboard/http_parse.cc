#include "dashboard/http_parse.h"

#include <string>

#include <boost/asio/buffer.hpp>

namespace tessera::dashboard {

HttpRequest PlainRequest(const boost::beast::http::request<boost::beast::http::string_body>& in) {
  namespace http = boost::beast::http;
  HttpRequest plain{.method = std::string(in.method_string()), .target = std::string(in.target())};
  if (auto it = in.find(http::field::cookie); it != in.end()) {
    plain.cookie = std::string(it->value());
  }
  if (auto it = in.find(http::field::authorization); it != in.end()) {
    plain.authorization = std::string(it->value());
  }
  return plain;
}

Result<HttpRequest> ParseHttpRequest(std::string_view bytes, uint32_t header_limit,
                                     uint32_t body_limit) {
  namespace http = boost::beast::http;
  http::request_parser<http::string_body> parser;
  parser.header_limit(header_limit);
  parser.body_limit(body_limit);
  parser.eager(true);
  boost::beast::error_code error;
  size_t used = 0;
  while (!error && used < bytes.size() && !parser.is_done()) {
    const size_t consumed =
        parser.put(boost::asio::buffer(bytes.data() + used, bytes.size() - used), error);
    if (consumed == 0 && !error) break;  // wants more than there is
    used += consumed;
  }
  if (error == http::error::need_more) error = {};
  if (!error && !parser.is_done()) {
    parser.put_eof(error);  // a body delimited by the end of the stream
  }
  if (error == http::error::header_limit || error == http::error::body_limit ||
      error == http::error::buffer_overflow) {
    return ResourceExhausted("request too large: {}", error.message());
  }
  if (error) return InvalidArgument("bad request: {}", error.message());
  if (!parser.is_done()) return InvalidArgument("bad request: it ends before it is complete");
  return PlainRequest(parser.get());
}

}  // namespace tessera::dashboard
