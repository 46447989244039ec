// The host's object store: every shard buffer on this host, by owner and handle.
#pragma once

#include <deque>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "core/future.h"
#include "core/ids.h"
#include "device/device.h"

namespace pathways {

// Buffers are futures: an entry exists from the moment the op that produces it is enqueued, so
// later ops can consume it before it is computed. Each client's buffers are kept apart: a handle
// only resolves within the client that created it. Thread-safe.
class ObjectStore {
 public:
  struct ShardKey {
    ArrayId array_id;
    int32_t shard;
    bool operator==(const ShardKey&) const = default;
    template <typename H>
    friend H AbslHashValue(H h, const ShardKey& k) {
      return H::combine(std::move(h), k.array_id, k.shard);
    }
  };

  // Registers the buffer of shard `key`. Replaces an earlier entry under the same key.
  void Put(const std::string& client, ShardKey key, Future<BufferPtr> buffer);
  // A ready NotFound future when the client has no such shard here (or the failure of the op that
  // was to make it; see FailArrays).
  Future<BufferPtr> Get(const std::string& client, ShardKey key) const;
  // The op that was to make arrays first .. first + count - 1 failed here with `why` before it
  // registered them: reading any of their shards that were never made (a fetch, a later run)
  // fails with that reason instead of "no shard". The last kFailedRangesPerClient failures of
  // each client are kept.
  void FailArrays(const std::string& client, ArrayId first, int64_t count, const absl::Status& why);
  static constexpr size_t kFailedRangesPerClient = 64;
  // Some of the client's ops never reached this host and were skipped (OpSequencer): what they
  // were to make is unknown here, so from now on every read of a shard the client does not have
  // here says `why` beside "no shard" (the last such reason, until the client goes).
  void NoteSkippedOps(const std::string& client, const absl::Status& why);
  // Drops the store's reference to every shard of the array; buffers still needed by queued work
  // stay alive until that work is done. Returns the number of shards dropped.
  int FreeArray(const std::string& client, ArrayId array_id);
  // The client went away: drops every shard it owns here and fails the transfers it expects.
  // Returns the number of shards dropped.
  int DropClient(const std::string& client, const absl::Status& why);

  // Names one block moving host to host: the run op's epoch, consuming node and input,
  // destination shard and source shard. Sender and receiver derive it independently.
  struct TransferId {
    Epoch epoch;
    int32_t node;
    int32_t input;
    int32_t dst_shard;
    int64_t src_shard;
    bool operator==(const TransferId&) const = default;
    template <typename H>
    friend H AbslHashValue(H h, const TransferId& t) {
      return H::combine(std::move(h), t.epoch, t.node, t.input, t.dst_shard, t.src_shard);
    }
  };

  // Rendezvous for host-to-host transfers: the consumer's side (Expect) and the producer's side
  // (Deliver) meet under (client, id) in either order, and the entry goes away once both came.
  // `source_host` sends it: a transfer from a host that left fails instead of waiting forever.
  Future<BufferPtr> ExpectTransfer(const std::string& client, const TransferId& id,
                                   const std::string& source_host = "");
  void DeliverTransfer(const std::string& client, const TransferId& id, absl::StatusOr<BufferPtr> data);

  // Fails the transfers of `epoch` into nodes first..last that were expected here and never
  // delivered, and drops those delivered but never expected. Returns how many were failed.
  int FailUndeliveredTransfers(const std::string& client, Epoch epoch, int first_node, int last_node,
                               const absl::Status& status);

  // Fails the transfers of `epoch` into nodes first..last expected here and not yet delivered,
  // for good: their entries stay, holding nothing, so blocks that come for them later are dropped
  // instead of waiting unclaimed for an epoch end that will not come (the run's exchange lost a
  // batch). They go with the client. Returns how many were failed.
  int FailTransfersForGood(const std::string& client, Epoch epoch, int first_node, int last_node,
                           const absl::Status& status);

  // The host is going: every transfer still expected fails with `why` (work waiting for it
  // ends instead of waiting forever).
  void FailAllTransfers(const absl::Status& why);

  // The hosts that have left the cluster, as the controller last said (it replaces the earlier
  // ones), each with why when known (empty: it went silent). Transfers expected from them fail
  // with Unavailable naming the host and why, now and from now on. Returns how many pending ones
  // were failed.
  int SetDepartedHosts(absl::flat_hash_map<std::string, std::string> hosts);

  size_t num_buffers() const;
  // The clients that own buffers here.
  std::vector<std::string> Clients() const;
  size_t num_pending_transfers() const;
  // Bytes of blocks delivered here that no consumer has claimed yet (blocks that came before
  // the run that uses them was set up here, or that no run here will use).
  int64_t unclaimed_bytes() const;

 private:
  struct Transfer {
    Promise<BufferPtr> promise;
    Future<BufferPtr> future;
    bool expected = false;
    bool delivered = false;
    std::string source_host;
    int64_t unclaimed_bytes = 0;  // of a block delivered before it was expected
  };
  absl::Status DepartedLocked(const std::string& host, const TransferId& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A client's arrays by id, each with its shards on this host: freeing an array touches only
  // its own shards.
  using ClientBuffers = absl::flat_hash_map<ArrayId, absl::flat_hash_map<int32_t, Future<BufferPtr>>>;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, ClientBuffers> buffers_ ABSL_GUARDED_BY(mu_);
  struct FailedArrays {
    ArrayId first, end;
    absl::Status why;
  };
  absl::flat_hash_map<std::string, std::deque<FailedArrays>> failed_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::Status> skipped_ ABSL_GUARDED_BY(mu_);  // NoteSkippedOps
  absl::flat_hash_map<std::pair<std::string, TransferId>, Transfer> transfers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> departed_ ABSL_GUARDED_BY(mu_);  // address: why
  int64_t unclaimed_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pathways
