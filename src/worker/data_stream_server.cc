#include "worker/data_stream_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {

absl::StatusOr<std::unique_ptr<DataStreamServer>> DataStreamServer::Start(const std::string& ip, TenantTokens token,
                                                                          std::string also, Handlers handlers,
                                                                          DataStreamTiming timing, int port,
                                                                          int max_connections,
                                                                          std::vector<StreamListener::Protocol> more) {
  std::unique_ptr<DataStreamServer> server(new DataStreamServer(std::move(handlers), timing));
  DataStreamServer* self = server.get();
  more.push_back({std::string(kDataStreamMagic, kStreamMagicBytes), std::move(token), std::move(also),
                  [self](int fd, const StreamListener& listener, const std::string& tenant) {
                    self->Serve(fd, listener, tenant);
                  }});
  auto listener = StreamListener::Start("data stream", ip, port, std::move(more), timing.connect, max_connections);
  if (!listener.ok()) return listener.status();
  server->listener_ = *std::move(listener);
  return server;
}

DataStreamServer::~DataStreamServer() { listener_.reset(); }

int64_t DataStreamServer::answered() const {
  absl::MutexLock lock(&mu_);
  return answered_;
}

absl::Status DataStreamServer::SendStatus(int fd, const absl::Status& why) {
  std::string frame = StreamStatusFrame(why);
  return TransferAll(fd, frame.data(), frame.size(), true, absl::Now() + timing_.silence, "refusal");
}

void DataStreamServer::Serve(int fd, const StreamListener& listener, const std::string& tenant) {
  absl::Status s;  // its hello was checked before it got this thread
  while (s.ok()) {
    pollfd polled[2] = {{fd, POLLIN, 0}, {listener.wake_fd(), POLLIN, 0}};
    const int ready = poll(polled, 2, static_cast<int>(absl::ToInt64Milliseconds(kIdle)));
    if (ready <= 0 || polled[1].revents != 0 || (polled[0].revents & (POLLIN | POLLHUP | POLLERR)) == 0) break;
    const absl::Time deadline = absl::Now() + timing_.silence;
    char length[4];
    s = TransferAll(fd, length, 4, false, deadline, "request");
    if (!s.ok()) break;
    const uint32_t bytes = DecodeStreamU32(length);
    if (bytes > kMaxStreamRequestBytes) {
      (void)SendStatus(fd, absl::InvalidArgumentError(absl::StrCat("a data stream request of ", bytes, " bytes (at most ",
                                                               kMaxStreamRequestBytes, ")")));
      break;
    }
    std::string body(bytes, '\0');
    s = TransferAll(fd, body.data(), bytes, false, deadline, "request");
    if (!s.ok()) break;
    rpc::StreamRequest request;
    if (!request.ParseFromString(body) || request.kind_case() == rpc::StreamRequest::KIND_NOT_SET) {
      // Bytes may follow it (a stage request's): the stream is at an unknown place, so it closes.
      (void)SendStatus(fd, absl::InvalidArgumentError("a data stream request that does not parse"));
      break;
    }
    if (absl::Status allowed = handlers_.refused ? handlers_.refused(tenant) : absl::OkStatus(); !allowed.ok()) {
      (void)SendStatus(fd, allowed);  // bytes may follow it: the connection closes
      break;
    }
    if (request.has_stage()) {
      // Its bytes follow: a refused one leaves the stream at an unknown place, so it closes.
      s = AnswerStage(fd, request.stage());
      continue;
    }
    if (request.has_enqueue()) {
      const rpc::EnqueueRequest& ops = request.enqueue();
      absl::Status taken = CheckClientCredential(ops.client_id(), ops.credential());
      if (taken.ok()) {
        taken = handlers_.enqueue ? handlers_.enqueue(ops) : absl::UnimplementedError("this stream takes no ops");
      }
      {
        absl::MutexLock lock(&mu_);
        ++answered_;
      }
      s = SendStatus(fd, taken);
      continue;
    }
    const rpc::FetchRequest& fetch = request.fetch();
    if (absl::Status client = CheckClientCredential(fetch.client_id(), fetch.credential()); !client.ok()) {
      s = SendStatus(fd, client);
      continue;
    }
    s = AnswerFetch(fd, fetch, listener);
  }
}

absl::Status DataStreamServer::AnswerStage(int fd, const rpc::StageRequest& request) {
  const absl::Status client = CheckClientCredential(request.client_id(), request.credential());
  absl::StatusOr<BufferPtr> landing = client.ok() ? handlers_.land(request) : client;
  if (!landing.ok()) {
    (void)SendStatus(fd, landing.status());
    return absl::Status(landing.status().code(), "refused before its bytes");  // the connection closes
  }
  BufferPtr buffer = *std::move(landing);
  const size_t bytes = static_cast<size_t>(buffer->byte_size());
  const absl::Time by = absl::Now() + timing_.silence +
                        absl::Seconds(static_cast<double>(bytes) / timing_.min_stage_bytes_per_second);
  PW_RETURN_IF_ERROR(TransferWhileMoving(fd, buffer->data(), bytes, false, timing_.silence, "staged bytes", by));
  absl::Status kept = handlers_.keep(request, std::move(buffer));
  {
    absl::MutexLock lock(&mu_);
    ++answered_;
  }
  return SendStatus(fd, kept);  // OK, or why the bytes are not kept
}

absl::Status DataStreamServer::AnswerFetch(int fd, const rpc::FetchRequest& request,
                                           const StreamListener& listener) {
  Future<std::vector<BufferPtr>> buffers = handlers_.fetch(request);
  // While the data is not ready the client hears that this worker is alive, and a client that
  // went away is noticed.
  const char waiting = kStreamWaiting;
  while (!buffers.IsReady()) {
    (void)buffers.AwaitFor(timing_.keepalive);
    if (buffers.IsReady()) break;
    if (listener.stopping()) return absl::CancelledError("the worker is stopping");
    PW_RETURN_IF_ERROR(TransferAll(fd, const_cast<char*>(&waiting), 1, true, absl::Now() + timing_.silence, "keepalive"));
  }
  const absl::StatusOr<std::vector<BufferPtr>>& r = buffers.Await();
  rpc::StreamHeader header;
  header.set_code(static_cast<int>(r.status().code()));
  header.set_message(std::string(r.status().message()));
  if (r.ok() && !request.status_only()) {
    for (size_t i = 0; i < r->size(); ++i) {
      rpc::ShardData* d = header.add_shards();
      d->set_shard(request.shards(static_cast<int>(i)));
      *d->mutable_spec() = ToProto(TensorSpec{(*r)[i]->dtype(), (*r)[i]->shape()});
    }
  }
  {
    // Counted as the answer starts: a client that has it all must find it counted.
    absl::MutexLock lock(&mu_);
    ++answered_;
  }
  std::string frame = StreamHeaderFrame(header);
  // A small answer goes in one send, its bytes copied after the header: the client then wakes
  // once for it, not once for the header and again for the bytes (a wake-up costs more CPU than
  // copying a few KiB, most of all on a VM).
  const bool whole = r.ok() && !request.status_only();
  size_t small = 0;
  if (whole) {
    for (const BufferPtr& b : *r) small += static_cast<size_t>(b->byte_size());
  }
  const bool one_send = whole && small <= kOneSendBytes;
  if (one_send) {
    for (const BufferPtr& b : *r) frame.append(b->data(), static_cast<size_t>(b->byte_size()));
  }
  PW_RETURN_IF_ERROR(TransferAll(fd, frame.data(), frame.size(), true, absl::Now() + timing_.silence, "header"));
  if (whole && !one_send) {
    for (const BufferPtr& b : *r) {
      char* data = b->data();
      const size_t size = static_cast<size_t>(b->byte_size());
      PW_RETURN_IF_ERROR(TransferWhileMoving(fd, data, size, true, timing_.silence, "shard bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pathways
