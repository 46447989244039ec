// Blocks between hosts (resharding, pipeline stages) over persistent TCP streams beside the
// collective meshes (tcp_links.h): one stream per (sending host, receiving host). A block is
// written from the producer's memory and read straight into the memory the receiver lands it in,
// in chunks, with a 64-bit size (no message size limit); only a small header goes with it. The
// receiver acknowledges each block once it has landed it, so a sender knows the block is in the
// receiver's hands before it tells anyone it is done.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/dcn_emulation.h"

namespace pathways::collective {

class TcpLinks;

// One host's block streams. Each peer it sends to has a sender thread (blocks to one peer go out
// in order, one at a time); each peer that sends to it has a reader thread. A stream that fails
// is closed; the sender's next block dials again. Thread-safe.
class BlockStreams {
 public:
  // Where a received block's bytes go, and what to call once they have all come (OK) or not.
  struct Landing {
    char* data = nullptr;
    std::function<void(absl::Status)> done;
  };
  // Called on a reader thread with the sending host, the block's header and its size: where to
  // put the bytes, or why not (sent back to the sender; the bytes are read and dropped).
  using LandFn =
      std::function<absl::StatusOr<Landing>(const std::string& from, const std::string& header, uint64_t bytes)>;

  // Bounds what a stream holds for one peer and how long a block may make no progress.
  static constexpr uint32_t kMaxHeaderBytes = 1 << 20;
  static constexpr size_t kChunkBytes = 4 << 20;
  static constexpr size_t kMaxReaders = 1024;

  // `links` (not owned) must outlive this. `dcn` (may be null) delays blocks between islands.
  // `timeout` bounds each chunk and each acknowledgement.
  BlockStreams(TcpLinks& links, std::string host, DcnEmulation* dcn, absl::Duration timeout, LandFn land);
  ~BlockStreams();  // fails what is still queued (Cancelled), closes every stream, joins threads
  BlockStreams(const BlockStreams&) = delete;
  BlockStreams& operator=(const BlockStreams&) = delete;

  // Queues a block for `peer`: `header`, then `bytes` from `data`, which `keep` keeps alive
  // until written. `done` runs on the peer's sender thread: OK once the peer landed the block, or
  // why it did not (the error names the peer).
  void Send(const std::string& peer, std::string header, const char* data, uint64_t bytes,
            std::shared_ptr<const void> keep, std::function<void(absl::Status)> done);

  // Blocks landed at their peers and landed here so far, and their bytes (metrics, tests).
  struct Counts {
    int64_t blocks_sent = 0, blocks_received = 0;
    int64_t bytes_sent = 0, bytes_received = 0;
  };
  Counts counts() const;

 private:
  struct Outgoing {
    std::string header;
    const char* data;
    uint64_t bytes;
    std::shared_ptr<const void> keep;
    std::function<void(absl::Status)> done;
  };
  struct Sender {
    std::deque<Outgoing> queue;
    int fd = -1;  // the stream; its thread closes it, the destructor only shuts it down
    std::thread thread;
  };
  struct Reader {
    int fd;
    std::string peer;
    std::thread thread;
    bool finished = false;
  };
  void SendLoop(const std::string& peer, Sender* sender);
  absl::Status SendOne(const std::string& peer, Sender& sender, const Outgoing& block);
  void Accept(int fd, const std::string& peer);
  void ReadLoop(Reader* reader);
  absl::Status ReadOne(int fd, const std::string& peer);

  TcpLinks& links_;
  const std::string host_;
  DcnEmulation* const dcn_;
  const absl::Duration timeout_;
  const LandFn land_;
  const int wake_fd_;  // readable once stopping: wakes readers waiting for their next block

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, std::unique_ptr<Sender>> senders_ ABSL_GUARDED_BY(mu_);
  std::list<Reader> readers_ ABSL_GUARDED_BY(mu_);
  Counts counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways::collective
