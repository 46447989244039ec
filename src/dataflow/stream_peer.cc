#include "dataflow/stream_peer.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "transport/auth.h"

namespace pathways::dataflow {
namespace {

// A receiver closes a connection idle longer than any sender keeps one.
constexpr absl::Duration kReceiverIdle = absl::Minutes(8);  // twice StreamPeer::kIdle
// A frame that stops coming halfway for this long: the sender is frozen or gone.
constexpr absl::Duration kFrameSilence = absl::Seconds(30);
constexpr absl::Duration kConnect = absl::Seconds(5);

}  // namespace

std::string DataflowFrame(const std::string& self, const std::string& graph, const std::vector<Envelope>& batch) {
  rpc::DataflowBatch m;
  m.set_graph(graph);
  m.set_src_host(self);
  for (const Envelope& e : batch) EnvelopeToProto(e, m.add_envelopes());
  std::string frame = EncodeStreamU32(static_cast<uint32_t>(m.ByteSizeLong()));
  m.AppendToString(&frame);
  return frame;
}

void EnvelopeToProto(const Envelope& e, rpc::DataflowEnvelope* p) {
  p->set_epoch(e.epoch);
  p->set_edge(e.edge);
  p->set_src_shard(e.src_shard);
  p->set_dst_shard(e.dst_shard);
  p->set_punctuation(e.punctuation);
  p->set_count(e.count);
  p->set_payload(e.payload);
}

Envelope EnvelopeFromProto(rpc::DataflowEnvelope& p) {
  return {p.epoch(), p.edge(), p.src_shard(), p.dst_shard(), p.punctuation(), p.count(),
          std::move(*p.mutable_payload())};
}

bool DecodeDataflowBatch(const char* data, size_t size, std::string* graph, std::vector<Envelope>* envelopes,
                         std::string* from) {
  rpc::DataflowBatch batch;
  if (!batch.ParseFromArray(data, static_cast<int>(size))) return false;
  *graph = batch.graph();
  if (from != nullptr) *from = batch.src_host();
  envelopes->clear();
  envelopes->reserve(batch.envelopes_size());
  for (rpc::DataflowEnvelope& e : *batch.mutable_envelopes()) envelopes->push_back(EnvelopeFromProto(e));
  return true;
}

StreamListener::Protocol DataflowStreamProtocol(
    std::string token,
    std::function<void(const std::string& from, const std::string& graph, std::vector<Envelope>)> receive,
    int max_connections) {
  StreamListener::Protocol p;
  p.magic = std::string(kDataflowStreamMagic, kStreamMagicBytes);
  p.token = std::move(token);
  p.frame = [receive = std::move(receive)](const char* data, size_t bytes) {
    std::string graph, from;
    std::vector<Envelope> envelopes;
    if (!DecodeDataflowBatch(data, bytes, &graph, &envelopes, &from)) {
      PW_LOG(Error) << "dataflow stream: a batch of " << bytes << " bytes that does not parse; the connection closes";
      return false;
    }
    receive(from, graph, std::move(envelopes));
    return true;
  };
  p.max_frame = kMaxDataflowFrameBytes;
  // A sender that closes or stalls within a batch loses it (it writes the batch again on a new
  // connection); a receiver closes a connection idle longer than any sender keeps one.
  p.frame_silence = kFrameSilence;
  p.idle = kReceiverIdle;
  p.max_connections = max_connections;
  return p;
}

StreamPeer::StreamPeer(std::string self, std::string peer, std::string ip, int port,
                       std::function<void(const absl::Status&)> connected, std::function<int()> resolve,
                       std::function<void()> lost)
    : self_(std::move(self)),
      peer_(std::move(peer)),
      ip_(std::move(ip)),
      port_(port),
      connected_(std::move(connected)),
      resolve_(std::move(resolve)),
      lost_(std::move(lost)) {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  absl::MutexLock lock(&mu_);
  last_write_ = absl::Now();
  thread_running_ = true;
  thread_ = std::thread([this] {
    NameThisThread("flow-peer");
    absl::StatusOr<int> fd = Connect(absl::InfiniteFuture());
    {
      absl::MutexLock lock(&mu_);
      if (fd.ok()) {
        fd_ = *fd;
        last_write_ = absl::Now();
      } else {
        gave_up_ = true;  // it takes nothing more: the caller sends another way
        thread_running_ = false;
      }
    }
    connected_(fd.status());
    if (fd.ok()) Loop();
  });
}

void StreamPeer::EnsureThreadLocked() {
  if (thread_running_ || gave_up_) return;
  if (thread_.joinable()) thread_.join();  // it has ended, or is ending: it holds no lock of ours
  thread_running_ = true;
  thread_ = std::thread([this] {
    NameThisThread("flow-peer");
    Loop();
  });
}

absl::StatusOr<int> StreamPeer::Connect(absl::Time deadline) {
  const std::string what = absl::StrCat("dataflow stream to ", peer_);
  auto bound = [deadline] { return std::clamp(deadline - absl::Now(), absl::Milliseconds(1), kConnect); };
  absl::StatusOr<int> fd = DialStream(what, ip_, port_, kDataflowStreamMagic, CallToken(), bound());
  if (!fd.ok()) return fd;
  absl::StatusOr<rpc::StreamHeader> admitted = ReadStreamHeader(*fd, bound(), what);
  absl::Status s = admitted.ok() ? HeaderStatus(*admitted) : admitted.status();
  if (!s.ok()) {
    close(*fd);
    return admitted.ok() ? absl::Status(s.code(), absl::StrCat(what, ": ", s.message())) : s;
  }
  return fd;
}

StreamPeer::~StreamPeer() {
  BeginClose(absl::Now() + absl::Seconds(2));
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
  {
    absl::MutexLock lock(&mu_);
    if (fd_ >= 0) close(fd_);  // idle, with no thread to close it
    fd_ = -1;
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

void StreamPeer::BeginClose(absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    close_deadline_ = std::min(close_deadline_, deadline);
    if (!queued_.empty()) EnsureThreadLocked();  // what is queued gets its grace
  }
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
}

int64_t StreamPeer::written() {
  absl::MutexLock lock(&mu_);
  return written_;
}

bool StreamPeer::WaitUntilWritten(int64_t batches, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto enough = [this, batches]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_ >= batches; };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

std::deque<std::string> StreamPeer::TakeQueued() {
  absl::MutexLock lock(&mu_);
  std::deque<std::string> out;
  for (Frame& f : queued_) out.push_back(std::move(f.bytes));
  queued_.clear();
  held_bytes_ = 0;
  return out;
}

Backlog StreamPeer::backlog() {
  absl::MutexLock lock(&mu_);
  Backlog held;
  if (held_bytes_ > 0) held = {held_bytes_, progress_};
  // What the socket took but the peer never acknowledged, once the connection retransmits it: a
  // peer cut off (packets dropped on the way) acknowledges nothing, while writes still go into
  // the socket's buffer for a while. The wait counts from the last acknowledgement, or from when
  // such bytes were first seen, if later (after an idle spell, the last acknowledgement is old).
  tcp_info info{};
  socklen_t length = sizeof(info);
  if (fd_ >= 0 && getsockopt(fd_, IPPROTO_TCP, TCP_INFO, &info, &length) == 0 && info.tcpi_unacked > 0 &&
      (info.tcpi_retransmits > 0 || info.tcpi_backoff > 0)) {
    const absl::Time now = absl::Now();
    if (unacked_seen_ == absl::InfiniteFuture()) unacked_seen_ = now;
    held += {static_cast<int64_t>(info.tcpi_unacked) * std::max<int64_t>(info.tcpi_snd_mss, 1),
             std::max(now - absl::Milliseconds(info.tcpi_last_ack_recv), unacked_seen_)};
  } else {
    unacked_seen_ = absl::InfiniteFuture();
  }
  return held;
}

int64_t StreamPeer::queued_bytes() {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

void StreamPeer::HoldLocked(size_t bytes) {
  if (held_bytes_ == 0) progress_ = absl::Now();  // waiting starts now
  held_bytes_ += static_cast<int64_t>(bytes);
}

void StreamPeer::Enqueue(const std::string& graph, const std::vector<Envelope>& batch) {
  Frame frame{DataflowFrame(self_, graph, batch)};
  mu_.Lock();
  if (fd_ >= 0 && !writing_ && queued_.empty() && absl::Now() >= last_write_ + kIdle) {
    close(fd_);  // idle: closed by this side, so no batch goes into a connection closing under it
    fd_ = -1;
  }
  if (writing_ || fd_ < 0 || !queued_.empty() || closing_) {
    HoldLocked(frame.bytes.size());
    queued_.push_back(std::move(frame));  // the thread's turn (it waits for this)
    EnsureThreadLocked();
    mu_.Unlock();
    return;
  }
  // The connection is idle: this thread writes, as much as the socket takes now.
  writing_ = true;
  const int fd = fd_;
  mu_.Unlock();
  // A receiver that closed (it restarted, or stopped) would take the batch into nothing: the
  // thread connects again instead.
  const bool closed = PeerClosed(fd);
  const ssize_t n = closed ? -1 : send(fd, frame.bytes.data(), frame.bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  const int error = closed ? EPIPE : errno;
  absl::MutexLock lock(&mu_);
  writing_ = false;
  if (n == static_cast<ssize_t>(frame.bytes.size())) {
    ++written_;
    last_write_ = absl::Now();
    return;
  }
  if (n >= 0 || error == EAGAIN || error == EWOULDBLOCK || error == EINTR) {
    frame.sent = n > 0 ? static_cast<size_t>(n) : 0;
  } else {
    close(fd_);  // broken: the thread connects again and writes the whole batch
    fd_ = -1;
  }
  HoldLocked(frame.bytes.size());
  queued_.push_front(std::move(frame));  // batches queued meanwhile come after it
  EnsureThreadLocked();
}

bool StreamPeer::WriteFrames(int fd, std::deque<Frame>& frames) {
  bool ok = true;
  while (ok && !frames.empty()) {
    Frame& f = frames.front();
    while (f.sent < f.bytes.size()) {
      const ssize_t n = send(fd, f.bytes.data() + f.sent, f.bytes.size() - f.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        f.sent += static_cast<size_t>(n);
        absl::MutexLock lock(&mu_);
        progress_ = absl::Now();  // a large frame to a slow peer moves too
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        PW_LOG(Info) << "dataflow stream to " << peer_ << " broke: " << Errno(errno);
        ok = false;
        break;
      }
      absl::Time deadline;
      {
        absl::MutexLock lock(&mu_);
        deadline = close_deadline_;
      }
      if (absl::Now() >= deadline) {
        ok = false;  // closing, and out of time: a peer that takes nothing must not hold up shutdown
        break;
      }
      pollfd polled[2] = {{fd, POLLOUT, 0}, {wake_fd_, POLLIN, 0}};
      const int timeout = deadline == absl::InfiniteFuture() ? -1 : RemainingMs(deadline);
      if (poll(polled, 2, timeout) > 0 && polled[1].revents != 0) {
        uint64_t count;
        (void)!read(wake_fd_, &count, sizeof(count));  // closing began: the deadline is read again
      }
    }
    if (!ok) break;
    {
      absl::MutexLock lock(&mu_);
      ++written_;
      held_bytes_ -= static_cast<int64_t>(f.bytes.size());
      last_write_ = progress_ = absl::Now();
    }
    frames.pop_front();
  }
  return ok;
}

void StreamPeer::Loop() {
  bool gave_up = false;
  while (!gave_up) {
    std::deque<Frame> frames;
    int fd;
    bool closing;
    absl::Time deadline;  // the close's, or none
    {
      absl::MutexLock lock(&mu_);
      auto turn = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_ && (!queued_.empty() || closing_); };
      if (!mu_.AwaitWithTimeout(absl::Condition(&turn), kThreadIdle) && queued_.empty()) {
        // Nothing for this thread: it ends, and the next batch the callers cannot write whole
        // starts another (Enqueue), so a sender's idle peers hold no threads.
        thread_running_ = false;
        return;
      }
      if (!turn()) continue;
      if (closing_ && (queued_.empty() || absl::Now() >= close_deadline_)) {
        if (!queued_.empty()) {
          PW_LOG(Error) << "dataflow: " << queued_.size() << " batches for " << peer_
                        << " dropped: the transport closed before the peer took them";
        }
        queued_.clear();
        held_bytes_ = 0;
        if (fd_ >= 0) close(fd_);
        fd_ = -1;
        thread_running_ = false;
        return;
      }
      writing_ = true;
      frames.swap(queued_);
      fd = fd_;
      closing = closing_;
      deadline = close_deadline_;
    }
    absl::Status connected;
    if (fd < 0) {
      // Not while closing: asking a peer that is gone where it listens would wait out the
      // close's grace, and batches for an incarnation that is gone are no use to a new one.
      if (resolve_ && !closing) {
        const int now_at = resolve_();
        if (now_at > 0) port_ = now_at;
      }
      // Closing, a peer that takes the connection and says nothing (its host drops packets, or
      // it is frozen) holds this thread no longer than the grace.
      absl::StatusOr<int> dialed = Connect(deadline);
      connected = dialed.status();
      if (dialed.ok()) fd = *dialed;
    }
    if (connected.ok() && fd >= 0 && PeerClosed(fd)) connected = absl::UnavailableError("the receiver closed the connection");
    const bool ok = connected.ok() && WriteFrames(fd, frames);
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (ok) {
      fd_ = fd;
      attempts_ = 0;
      continue;
    }
    if (fd >= 0) close(fd);
    fd_ = -1;
    if (!frames.empty()) frames.front().sent = 0;  // written again, whole, on a new connection
    for (auto it = frames.rbegin(); it != frames.rend(); ++it) queued_.push_front(std::move(*it));
    if (++attempts_ >= kAttempts && !queued_.empty()) {
      const std::string why = connected.ok() ? std::string("the last broke") : connected.ToString();
      if (lost_ && !closing_) {
        PW_LOG(Warning) << "dataflow stream to " << peer_ << ": " << attempts_ << " connections failed (" << why
                        << "); its " << queued_.size() << " batches and later ones go another way";
        gave_up = gave_up_ = true;
        thread_running_ = false;
        continue;  // the lock goes with this iteration
      }
      if (closing_) {  // this side is going: the next batch would find the peer no nearer
        PW_LOG(Warning) << "dataflow: " << queued_.size() << " batches for " << peer_
                        << " dropped as this side closes: " << attempts_ << " connections failed (" << why << ")";
        queued_.clear();
        held_bytes_ = 0;
        thread_running_ = false;
        return;
      }
      PW_LOG(Error) << "dataflow: a batch for " << peer_ << " dropped: " << attempts_ << " connections failed ("
                    << why << ")";
      held_bytes_ -= static_cast<int64_t>(queued_.front().bytes.size());
      queued_.pop_front();
      attempts_ = 0;
    }
    if (!closing_) {
      auto closing = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closing_; };
      mu_.AwaitWithTimeout(absl::Condition(&closing), absl::Milliseconds(50) * (1 << std::max(0, attempts_ - 1)));
    }
  }
  lost_();  // gave up: nothing more is written here
}

}  // namespace pathways::dataflow
