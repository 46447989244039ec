// The dashboard's static files (src/ops/assets/), compiled into the binary by
// cmake/embed_assets.cmake: what the HTTP server serves is fixed at build time.
#pragma once

#include <string_view>
#include <vector>

namespace pathways {

struct Asset {
  std::string_view name;          // the file's name, e.g. "index.html"
  std::string_view content_type;  // from its extension
  std::string_view data;
};

const std::vector<Asset>& Assets();

}  // namespace pathways
