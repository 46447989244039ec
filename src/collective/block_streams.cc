#include "collective/block_streams.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collective/tcp_links.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "core/status_macros.h"

namespace pathways::collective {
namespace {

constexpr char kStreamKey[] = "#blocks";
constexpr uint32_t kFrameMagic = 0x50574246;  // "PWBF"
constexpr uint32_t kAckMagic = 0x50574241;    // "PWBA"
constexpr uint32_t kMaxAckMessageBytes = 1 << 16;

// Precedes every block on a stream: the header, then the bytes follow.
struct Frame {
  uint32_t magic;
  uint32_t header_bytes;
  uint64_t bytes;
  // Emulated DCN only: when the block may be taken as landed (Unix microseconds). 0: at once.
  int64_t deliver_us;
};

// The receiver's answer to each block: OK, or an error code and message (which follows).
struct Ack {
  uint32_t magic;
  int32_t code;
  uint32_t message_bytes;
  uint32_t unused;
};

// Moves `len` bytes in chunks, each allowed `timeout` to make progress: a large block is never
// cut off for being large, and a stalled peer is found within one chunk's timeout.
absl::Status Stream(int fd, char* data, uint64_t len, bool write, absl::Duration timeout, const std::string& what) {
  for (uint64_t done = 0; done < len;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(len - done, BlockStreams::kChunkBytes));
    PW_RETURN_IF_ERROR(TransferAll(fd, data + done, n, write, absl::Now() + timeout, what));
    done += n;
  }
  return absl::OkStatus();
}

}  // namespace

BlockStreams::BlockStreams(TcpLinks& links, std::string host, DcnEmulation* dcn, absl::Duration timeout, LandFn land)
    : links_(links),
      host_(std::move(host)),
      dcn_(dcn),
      timeout_(timeout),
      land_(std::move(land)),
      wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  links_.AcceptStreams(kStreamKey, [this](int fd, const std::string& peer) { Accept(fd, peer); });
}

BlockStreams::~BlockStreams() {
  links_.AcceptStreams(kStreamKey, nullptr);  // no new readers once this returns
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    // Wakes whatever waits on a socket; each thread closes its own.
    for (Reader& r : readers_) {
      if (r.fd >= 0) shutdown(r.fd, SHUT_RDWR);
      threads.push_back(std::move(r.thread));
    }
    for (auto& [peer, s] : senders_) {
      if (s->fd >= 0) shutdown(s->fd, SHUT_RDWR);
      threads.push_back(std::move(s->thread));
    }
  }
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

BlockStreams::Counts BlockStreams::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

void BlockStreams::Send(const std::string& peer, std::string header, const char* data, uint64_t bytes,
                        std::shared_ptr<const void> keep, std::function<void(absl::Status)> done) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      std::unique_ptr<Sender>& sender = senders_[peer];
      if (sender == nullptr) {
        sender = std::make_unique<Sender>();
        sender->thread = std::thread([this, peer, s = sender.get()] {
          NameThisThread("block-send");
          SendLoop(peer, s);
        });
      }
      sender->queue.push_back({std::move(header), data, bytes, std::move(keep), std::move(done)});
      return;
    }
  }
  done(absl::CancelledError(absl::StrCat("host ", host_, " is shutting down: block for ", peer, " not sent")));
}

void BlockStreams::SendLoop(const std::string& peer, Sender* sender) {
  while (true) {
    Outgoing block;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !sender->queue.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stop_) break;
      block = std::move(sender->queue.front());
      sender->queue.pop_front();
    }
    absl::Status s = SendOne(peer, *sender, block);
    {
      absl::MutexLock lock(&mu_);
      if (!s.ok() && sender->fd >= 0) {
        close(sender->fd);  // the next block dials again
        sender->fd = -1;
      }
      if (s.ok()) {
        ++counts_.blocks_sent;
        counts_.bytes_sent += static_cast<int64_t>(block.bytes);
      }
    }
    block.done(s.ok() ? s
                      : absl::Status(s.code(), absl::StrCat("block of ", block.bytes, " bytes from ", host_, " to ",
                                                            peer, ": ", s.message())));
  }
  // Stopping: what is still queued will not be sent.
  std::deque<Outgoing> left;
  {
    absl::MutexLock lock(&mu_);
    left.swap(sender->queue);
    if (sender->fd >= 0) close(sender->fd);
    sender->fd = -1;
  }
  for (Outgoing& block : left) {
    block.done(absl::CancelledError(absl::StrCat("host ", host_, " is shutting down: block for ", peer, " not sent")));
  }
}

absl::Status BlockStreams::SendOne(const std::string& peer, Sender& sender, const Outgoing& block) {
  int fd;
  {
    absl::MutexLock lock(&mu_);
    if (sender.fd >= 0 && PeerClosed(sender.fd)) {
      close(sender.fd);
      sender.fd = -1;
    }
    fd = sender.fd;
  }
  if (fd < 0) {
    PW_ASSIGN_OR_RETURN(fd, links_.DialStream(peer, kStreamKey, absl::Now() + timeout_));
    absl::MutexLock lock(&mu_);
    sender.fd = fd;  // from now on a shutdown can wake this thread
    if (stop_) return absl::CancelledError("shutting down");
  }
  Frame frame{kFrameMagic, static_cast<uint32_t>(block.header.size()), block.bytes, 0};
  if (dcn_ != nullptr && dcn_->Crosses(peer)) {
    frame.deliver_us = absl::ToUnixMicros(dcn_->Arrival(peer, sizeof(frame) + block.header.size() + block.bytes,
                                                        absl::Now()));
  }
  std::string head(sizeof(frame), '\0');
  std::memcpy(head.data(), &frame, sizeof(frame));
  head += block.header;
  PW_RETURN_IF_ERROR(TransferAll(fd, head.data(), head.size(), true, absl::Now() + timeout_, "block header"));
  PW_RETURN_IF_ERROR(Stream(fd, const_cast<char*>(block.data), block.bytes, true, timeout_, "block data"));
  // The acknowledgement comes once the receiver has landed the block (after its emulated
  // arrival, when the DCN is emulated).
  const absl::Time landed_by =
      std::max(absl::Now(), frame.deliver_us > 0 ? absl::FromUnixMicros(frame.deliver_us) : absl::InfinitePast());
  Ack ack{};
  PW_RETURN_IF_ERROR(
      TransferAll(fd, reinterpret_cast<char*>(&ack), sizeof(ack), false, landed_by + timeout_, "block acknowledgement"));
  if (ack.magic != kAckMagic || ack.message_bytes > kMaxAckMessageBytes) {
    return absl::DataLossError("the peer answered a block with something that is not an acknowledgement");
  }
  std::string message(ack.message_bytes, '\0');
  PW_RETURN_IF_ERROR(TransferAll(fd, message.data(), message.size(), false, absl::Now() + timeout_,
                                 "block acknowledgement"));
  if (ack.code == 0) return absl::OkStatus();
  if (ack.code < 0 || ack.code > static_cast<int>(absl::StatusCode::kUnauthenticated)) ack.code = 2;  // kUnknown
  return absl::Status(static_cast<absl::StatusCode>(ack.code), message);
}

void BlockStreams::Accept(int fd, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  // Readers whose stream ended leave their slot.
  for (auto it = readers_.begin(); it != readers_.end();) {
    if (it->finished) {
      it->thread.join();
      it = readers_.erase(it);
    } else {
      ++it;
    }
  }
  if (stop_ || readers_.size() >= kMaxReaders) {
    PW_LOG(Warning) << "host " << host_ << " refused a block stream from " << peer
                    << (stop_ ? ": shutting down" : ": too many streams");
    close(fd);
    return;
  }
  Reader& r = readers_.emplace_back();
  r.fd = fd;
  r.peer = peer;
  r.thread = std::thread([this, reader = &r] {
    NameThisThread("block-read");
    ReadLoop(reader);
  });
}

void BlockStreams::ReadLoop(Reader* reader) {
  const int fd = reader->fd;
  absl::Status s;
  while (s.ok()) {
    pollfd p[2] = {{fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      s = absl::UnavailableError(absl::StrCat("poll: ", Errno(errno)));
      break;
    }
    if (p[1].revents != 0) break;  // stopping
    s = ReadOne(fd, reader->peer);
  }
  if (!s.ok() && !absl::IsUnavailable(s)) {
    PW_LOG(Warning) << "host " << host_ << " closed the block stream from " << reader->peer << ": " << s;
  }
  absl::MutexLock lock(&mu_);
  close(fd);
  reader->fd = -1;
  reader->finished = true;
}

absl::Status BlockStreams::ReadOne(int fd, const std::string& peer) {
  Frame frame{};
  PW_RETURN_IF_ERROR(
      TransferAll(fd, reinterpret_cast<char*>(&frame), sizeof(frame), false, absl::Now() + timeout_, "block header"));
  if (frame.magic != kFrameMagic || frame.header_bytes > kMaxHeaderBytes) {
    return absl::DataLossError("a block stream carried something that is not a block");
  }
  std::string header(frame.header_bytes, '\0');
  PW_RETURN_IF_ERROR(TransferAll(fd, header.data(), header.size(), false, absl::Now() + timeout_, "block header"));
  absl::StatusOr<Landing> landing = land_(peer, header, frame.bytes);
  absl::Status landed;
  if (landing.ok()) {
    landed = Stream(fd, landing->data, frame.bytes, false, timeout_, "block data");
    if (landed.ok() && frame.deliver_us > 0) {
      const absl::Duration early = absl::FromUnixMicros(frame.deliver_us) - absl::Now();
      if (early > absl::ZeroDuration()) absl::SleepFor(std::min(early, timeout_));
    }
    landing->done(landed.ok() ? absl::OkStatus()
                              : absl::Status(landed.code(), absl::StrCat("block from ", peer, " to ", host_,
                                                                         " cut short: ", landed.message())));
    PW_RETURN_IF_ERROR(landed);  // the stream is broken: nothing to acknowledge
  } else {
    // Refused: the bytes are read and dropped, and the refusal goes back.
    std::vector<char> scratch(std::min<uint64_t>(frame.bytes, kChunkBytes));
    for (uint64_t left = frame.bytes; left > 0;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(left, scratch.size()));
      PW_RETURN_IF_ERROR(TransferAll(fd, scratch.data(), n, false, absl::Now() + timeout_, "block data"));
      left -= n;
    }
    landed = landing.status();
  }
  {
    absl::MutexLock lock(&mu_);
    if (landed.ok()) {
      ++counts_.blocks_received;
      counts_.bytes_received += static_cast<int64_t>(frame.bytes);
    }
  }
  const std::string message(landed.message().substr(0, kMaxAckMessageBytes));
  Ack ack{kAckMagic, static_cast<int32_t>(landed.code()), static_cast<uint32_t>(message.size()), 0};
  std::string out(sizeof(ack), '\0');
  std::memcpy(out.data(), &ack, sizeof(ack));
  out += message;
  return TransferAll(fd, out.data(), out.size(), true, absl::Now() + timeout_, "block acknowledgement");
}

}  // namespace pathways::collective
