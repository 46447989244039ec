// Network namespaces for tests with real processes as if on several machines: each member (a
// controller, a worker, a tenant) gets a namespace and an address of its own on a shared bridge,
// reachable by a non-loopback address. Needs root; made and removed by the test itself.
#pragma once

#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "testing/subprocess.h"

namespace pathways {

// The network namespaces and links of one test: a host per member, on one bridge, removed (with the processes' sockets in them) when it ends.
class Network {
 public:
  // One namespace per member, each with address 10.<subnet>.0.<i + 1>/24 on a shared bridge.
  explicit Network(const std::vector<std::string>& members) {
    prefix_ = absl::StrCat("pw", getpid() % 100000);
    subnet_ = static_cast<int>(getpid() % 200) + 20;
    ok_ = Run({absl::StrCat("ip netns add ", Ns("sw")), absl::StrCat("ip -n ", Ns("sw"), " link add br0 type bridge"),
               absl::StrCat("ip -n ", Ns("sw"), " link set br0 up")});
    namespaces_.push_back(Ns("sw"));
    for (size_t i = 0; ok_ && i < members.size(); ++i) {
      const std::string& m = members[i];
      namespaces_.push_back(Ns(m));
      addresses_[m] = absl::StrCat("10.", subnet_, ".0.", i + 1);
      ok_ = Run({absl::StrCat("ip netns add ", Ns(m)),
                 absl::StrCat("ip link add e", m, " netns ", Ns(m), " type veth peer name ", Port(m), " netns ", Ns("sw")),
                 absl::StrCat("ip -n ", Ns(m), " addr add ", addresses_[m], "/24 dev e", m),
                 absl::StrCat("ip -n ", Ns(m), " link set e", m, " up"), absl::StrCat("ip -n ", Ns(m), " link set lo up"),
                 absl::StrCat("ip -n ", Ns("sw"), " link set ", Port(m), " master br0"),
                 absl::StrCat("ip -n ", Ns("sw"), " link set ", Port(m), " up")});
    }
  }
  ~Network() {
    for (const std::string& ns : namespaces_) RunShell(absl::StrCat("ip netns del ", ns), absl::Seconds(120));
  }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  std::string Ns(const std::string& member) const { return absl::StrCat(prefix_, member); }
  std::string Address(const std::string& member) { return addresses_[member]; }
  // `member`'s port on the bridge: down drops everything to and from it, silently.
  absl::Status SetConnected(const std::string& member, bool up) {
    auto [status, out] = RunShell(absl::StrCat("ip -n ", Ns("sw"), " link set ", Port(member), up ? " up" : " down"), absl::Seconds(120));
    if (status != 0) return absl::InternalError(out);
    return absl::OkStatus();
  }
  // Whether `from` can send to `to`: a blackhole route in `from`'s namespace drops what it sends to
  // `to` (everything else, the controller included, still goes through).
  absl::Status SetReachable(const std::string& from, const std::string& to, bool reachable) {
    auto [status, out] = RunShell(absl::StrCat("ip -n ", Ns(from), " route ", reachable ? "del" : "add", " blackhole ",
                                               Address(to), "/32"),
                                  absl::Seconds(120));
    if (status != 0) return absl::InternalError(out);
    return absl::OkStatus();
  }
  // argv run inside `member`'s namespace (`ip netns exec` execs it: same process id).
  std::vector<std::string> In(const std::string& member, std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {IpCommand(), "netns", "exec", Ns(member)});
    return argv;
  }
  // Where the ip command is (Subprocess does not search the PATH).
  static std::string IpCommand() { return access("/usr/sbin/ip", X_OK) == 0 ? "/usr/sbin/ip" : "/sbin/ip"; }

 private:
  std::string Port(const std::string& member) const { return absl::StrCat(prefix_, "p", member); }
  bool Run(const std::vector<std::string>& commands) {
    for (const std::string& c : commands) {
      auto [status, out] = RunShell(c, absl::Seconds(120));
      if (status != 0) {
        error_ = absl::StrCat(c, ": ", out);
        return false;
      }
    }
    return true;
  }
  std::string prefix_;
  int subnet_ = 0;
  bool ok_ = false;
  std::string error_;
  std::vector<std::string> namespaces_;
  std::map<std::string, std::string> addresses_;
};

// Why network namespaces cannot be used here (not root, no iproute2), or empty when they can.
std::string NetworkNamespacesUnavailable();

}  // namespace pathways
