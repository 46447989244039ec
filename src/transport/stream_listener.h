// Plain TCP streams beside a process's gRPC port, for the paths where gRPC's thread hand-offs
// cost more than the work: a client's data streams to a worker (transport/data_stream.h),
// dataflow batches between hosts and the controller (dataflow/grpc_transport.h) and a client's
// schedule stream to the controller (transport/schedule_stream.h). One listener per process
// serves them all on one port; each connection opens with a hello,
//   8 bytes of magic naming its protocol, u32 n (little-endian), a token (n bytes, may be empty),
// and the protocol decides what follows. Once its hello is in and its token is one its protocol
// admits, a connection gets a thread of its own, or, for a protocol of frames that only flow in
// (dataflow batches), joins the listener's one reader thread, which reads every such connection
// (so a controller of 512 hosts holds one thread for their streams, not 512). Until then it
// waits in the acceptor's poll set, so silent connections hold descriptors, not threads. One
// refused (a wrong token, every slot taken) is told why in a header frame (kStreamHeader, u32 n,
// rpc::StreamHeader) and closed.
#pragma once

#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/pathways.pb.h"
#include "transport/tenant_tokens.h"

namespace pathways {

inline constexpr size_t kStreamMagicBytes = 8;
inline constexpr uint32_t kMaxStreamTokenBytes = 4096;
inline constexpr uint32_t kMaxStreamHeaderBytes = 16 << 20;
inline constexpr char kStreamWaiting = 'W';
inline constexpr char kStreamHeader = 'H';

class StreamListener {
 public:
  static constexpr int kMaxConnections = 256;
  // Connections whose hello has not all come wait without a thread, this many at most: beyond
  // it the oldest is closed.
  static constexpr size_t kMaxGreeting = 1024;

  struct Protocol {
    std::string magic;  // kStreamMagicBytes bytes
    // Tokens admitted: `token`'s (a tenant's, or one token), or `also` (when not empty). An open
    // `token` admits every connection.
    TenantTokens token;
    std::string also;
    // Serves one admitted connection on its own thread, until the stream ends or the listener
    // stops (poll `listener.wake_fd()` beside the socket). The listener closes `fd` after.
    // `tenant`: whose token the hello showed ("" for `also`, the shared token or an open one).
    std::function<void(int fd, const StreamListener& listener, const std::string& tenant)> serve;
    // Or, for a protocol whose frames only flow in: the connection is told it is admitted (a
    // header frame of OK), then each frame that comes (u32 n little-endian, then n bytes, at most
    // `max_frame`) is handed to `frame` on the listener's reader thread, which must not be held:
    // it reads every such connection. False closes the connection (the frame is malformed). A
    // connection closes too when a frame stops coming part way for `frame_silence` (its sender
    // is frozen or gone: it writes the frame again on a new connection), or no frame comes for
    // `idle` (looked at every second while a frame is part way, every 30 s otherwise). `serve`
    // must be empty then.
    std::function<bool(const char* data, size_t bytes)> frame;
    uint32_t max_frame = 0;
    absl::Duration frame_silence = absl::Seconds(30);
    absl::Duration idle = absl::Minutes(8);
    // At most this many of this protocol's connections at once (each has a thread, unless it is
    // one of frames); more are turned away, told they were not served. 0: the listener's
    // `max_connections`. Protocols count apart, so tenants' streams cannot take the slots of the
    // hosts' dataflow.
    int max_connections = 0;
  };

  // Listens on `ip` (a port of its own, or `port`); `what` names the listener in errors. At most
  // `max_connections` connections of each protocol are served at once (unless the protocol says
  // otherwise); a hello must be complete within `connect`.
  static absl::StatusOr<std::unique_ptr<StreamListener>> Start(const std::string& what, const std::string& ip,
                                                               int port, std::vector<Protocol> protocols,
                                                               absl::Duration connect = absl::Seconds(5),
                                                               int max_connections = kMaxConnections);
  ~StreamListener();  // closes the listener and every connection, joins the threads
  StreamListener(const StreamListener&) = delete;
  StreamListener& operator=(const StreamListener&) = delete;

  int port() const { return port_; }
  // Readable once the listener stops.
  int wake_fd() const { return wake_fd_; }
  bool stopping() const;

 private:
  struct Connection {
    int fd;
    const Protocol* protocol;
    std::thread thread;
    bool finished = false;
  };
  struct Greeting;
  struct FrameReader;  // a connection of a protocol of frames, as the reader thread reads it
  enum class Heard { kMore, kHello, kWrongToken, kBad };
  StreamListener(int listen_fd, int port, int wake_fd, int epoll_fd, std::vector<Protocol> protocols,
                 absl::Duration connect, int max_connections);
  Heard Listen(Greeting& g);  // reads what has come of `g`'s hello, without blocking
  void AcceptLoop();
  // A thread for the connection, or a place among the reader thread's, or it is turned away.
  void Admit(int fd, const Protocol* protocol, std::string tenant);
  void ReadLoop();  // the reader thread: every connection of a protocol of frames
  // Reads what has come on `c` and hands over its whole frames; false when it is to close.
  bool ReadFrames(FrameReader& c, absl::Time now);
  void CloseReader(FrameReader* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int listen_fd_, port_, wake_fd_;
  const std::vector<Protocol> protocols_;
  const absl::Duration connect_;
  const int max_connections_;
  std::thread acceptor_;
  const int epoll_fd_;  // the reader thread's (-1: no protocol of frames)
  std::thread reader_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  // Connections of protocols of frames: added by the acceptor, read and removed by the reader.
  absl::flat_hash_set<FrameReader*> readers_ ABSL_GUARDED_BY(mu_);
};

// Whether this process uses and offers the plain streams that carry control traffic (dataflow
// batches, schedule requests): not with TLS (they are not encrypted), nor with
// PATHWAYS_PLAIN_STREAMS=0 in the environment (everything then goes through gRPC, as it did
// before these streams; data streams are not affected).
bool PlainControlStreams();

// The client's side: connects to `ip`:`port` and sends the hello of protocol `magic` with
// `token`, within `timeout`. A connected, non-blocking socket (TCP_NODELAY), or why not, the
// error starting with `what`.
absl::StatusOr<int> DialStream(const std::string& what, const std::string& ip, int port, const std::string& magic,
                               const std::string& token, absl::Duration timeout);

// A header frame carrying `header`; one carrying only `status`.
std::string StreamHeaderFrame(const rpc::StreamHeader& header);
std::string StreamStatusFrame(const absl::Status& status);
// Tells a connection why it is refused (`not_served`: every thread is taken) and closes it,
// without waiting on the peer.
void TurnAwayStream(int fd, const absl::Status& why, bool not_served);
// Reads one header frame, failing when no byte comes for `silence` or the frame is malformed;
// `what` names the exchange in errors.
absl::StatusOr<rpc::StreamHeader> ReadStreamHeader(int fd, absl::Duration silence, const std::string& what);
// The status a header carries.
absl::Status HeaderStatus(const rpc::StreamHeader& header);

std::string EncodeStreamU32(uint32_t v);
uint32_t DecodeStreamU32(const char* p);

}  // namespace pathways
