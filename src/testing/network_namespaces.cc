#include "testing/network_namespaces.h"

namespace pathways {

std::string NetworkNamespacesUnavailable() {
  if (geteuid() != 0) return "network namespaces need root";
  if (RunShell("ip netns list", absl::Seconds(60)).first != 0) {
    return "the ip command (iproute2) cannot manage network namespaces";
  }
  return "";
}

}  // namespace pathways
