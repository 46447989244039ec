// Small helpers over non-blocking TCP sockets: the collective links (collective/peer_mesh.cc,
// tcp_links.cc), block streams, and the data streams between clients and workers.
#pragma once

#include <sys/socket.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace pathways {

// Milliseconds left until `deadline`, for poll(): 0 once it has passed.
int RemainingMs(absl::Time deadline);
std::string Errno(int err);
// TCP_NODELAY and non-blocking.
void Configure(int fd);
// TCP keepalive probes after `idle_ms` of silence, `idle_ms` / 2 apart, 3 of them, and data
// unacknowledged (or a receive window closed) for max(30 s, `idle_ms` * 5) given up: a
// connection whose other end's machine vanished (no FIN, no reset) fails within seconds when
// idle and within that bound when sending, instead of the kernel's 2 hours or 15 minutes. An
// idle connection to a frozen process stays up (its kernel answers the probes); one that fills
// a frozen process's window fails after the bound.
void KeepAlive(int fd, int idle_ms);
// Writes or reads all of [data, data+len) on a non-blocking socket before `deadline`; `what` names
// the exchange in errors.
absl::Status TransferAll(int fd, char* data, size_t len, bool write, absl::Time deadline, const std::string& what);
// The same, failing (DeadlineExceeded) when no byte moves for `silence`: for streams whose length
// is unbounded, where a deadline for the whole would be a minimum speed. And at `by`, when one is
// given (a minimum speed, where one is wanted).
absl::Status TransferWhileMoving(int fd, char* data, size_t len, bool write, absl::Duration silence,
                                 const std::string& what, absl::Time by = absl::InfiniteFuture());
// Reads a frame of `len` bytes into `into` (replacing what it held), as TransferWhileMoving does,
// growing it with what arrives (1 MiB at a time) instead of reserving `len` at once: a peer that
// announces a large frame and then stalls or trickles holds no more of this process's memory
// than it sent. A large frame's room is let go once the next, smaller one is read.
absl::Status ReadFrameWhileMoving(int fd, std::string& into, size_t len, absl::Duration silence,
                                  const std::string& what);
// A connection the peer closed (or broke) since it was last used, whether or not bytes it sent
// before are still unread.
bool PeerClosed(int fd);
// PeerClosed for each of `fds` in one system call (a negative fd is never closed): a collective
// checks every connection of its mesh at each call, where a call per connection cost a 16-host
// stencil a fifth of its CPU.
std::vector<bool> PeersClosed(absl::Span<const int> fds);
// "ip:port" or "[ip6]:port".
absl::StatusOr<sockaddr_storage> ParseAddress(const std::string& address, socklen_t* len);
// The host part of "host:port" or "[ip6]:port", without brackets.
std::string HostOfAddress(const std::string& address);

}  // namespace pathways
