// The dashboard's static files, built into the binary (no CDN, nothing read from disk at run
// time): dashboard/assets/* turned into a generated .cc by dashboard/embed_assets.cmake.
#pragma once

#include <string_view>

namespace tessera::dashboard {

struct Asset {
  std::string_view path;  // "/dashboard.js"
  std::string_view content_type;
  std::string_view body;
};

// The asset served at `path` ("/" is index.html); nullptr when there is none.
const Asset* FindAsset(std::string_view path);

}  // namespace tessera::dashboard
