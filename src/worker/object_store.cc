#include "worker/object_store.h"

#include <limits>

#include <optional>

#include "absl/strings/str_cat.h"

namespace pathways {

void ObjectStore::Put(const std::string& client, ShardKey key, Future<BufferPtr> buffer) {
  absl::MutexLock lock(&mu_);
  buffers_[client][key.array_id][key.shard] = std::move(buffer);
}

Future<BufferPtr> ObjectStore::Get(const std::string& client, ShardKey key) const {
  std::string skipped;
  {
    absl::MutexLock lock(&mu_);
    auto c = buffers_.find(client);
    if (c != buffers_.end()) {
      auto a = c->second.find(key.array_id);
      if (a != c->second.end()) {
        auto it = a->second.find(key.shard);
        if (it != a->second.end()) return it->second;
      }
    }
    if (auto f = failed_.find(client); f != failed_.end()) {
      for (const FailedArrays& range : f->second) {
        if (key.array_id < range.first || key.array_id >= range.end) continue;
        return Future<BufferPtr>::Ready(absl::Status(
            range.why.code(), absl::StrCat("array ", key.array_id.value(), " was not made on this host: ", range.why.message())));
      }
    }
    if (auto s = skipped_.find(client); s != skipped_.end()) {
      skipped = absl::StrCat("; it may have been to come from ops of this client that never came: ", s->second.message());
    }
  }
  return Future<BufferPtr>::Ready(absl::NotFoundError(
      absl::StrCat("no shard ", key.shard, " of array ", key.array_id.value(), " on this host", skipped)));
}

void ObjectStore::NoteSkippedOps(const std::string& client, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  skipped_[client] = why;
}

void ObjectStore::FailArrays(const std::string& client, ArrayId first, int64_t count, const absl::Status& why) {
  if (count <= 0 || why.ok()) return;
  // Ids come from the client: a range that would pass the largest id ends there.
  constexpr int64_t kLast = std::numeric_limits<int64_t>::max();
  const ArrayId end = first.value() > kLast - count ? ArrayId(kLast) : first + count;
  absl::MutexLock lock(&mu_);
  std::deque<FailedArrays>& ranges = failed_[client];
  ranges.push_back({first, end, why});
  if (ranges.size() > kFailedRangesPerClient) ranges.pop_front();
}

int ObjectStore::FreeArray(const std::string& client, ArrayId array_id) {
  // The last references go after the lock: a buffer may carry what takes a while to tear down
  // (a kept autograd graph), and every Get and Put waits on the lock.
  ClientBuffers::mapped_type released;
  {
    absl::MutexLock lock(&mu_);
    auto c = buffers_.find(client);
    if (c == buffers_.end()) return 0;
    auto a = c->second.find(array_id);
    if (a == c->second.end()) return 0;
    released = std::move(a->second);
    c->second.erase(a);
    if (c->second.empty()) buffers_.erase(c);
  }
  return static_cast<int>(released.size());
}

int ObjectStore::DropClient(const std::string& client, const absl::Status& why) {
  std::vector<Promise<BufferPtr>> failed;
  ClientBuffers released;  // freed after the lock, as in FreeArray
  int dropped = 0;
  {
    absl::MutexLock lock(&mu_);
    if (auto c = buffers_.find(client); c != buffers_.end()) {
      for (const auto& [id, shards] : c->second) dropped += static_cast<int>(shards.size());
      released = std::move(c->second);
      buffers_.erase(c);
    }
    failed_.erase(client);
    skipped_.erase(client);
    absl::erase_if(transfers_, [&](auto& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (entry.first.first != client) return false;
      if (!entry.second.delivered) failed.push_back(std::move(entry.second.promise));
      unclaimed_bytes_ -= entry.second.unclaimed_bytes;
      return true;
    });
  }
  for (auto& p : failed) p.Set(why);  // outside the lock: continuations may run inline
  return dropped;
}

absl::Status ObjectStore::DepartedLocked(const std::string& host, const TransferId& id) const {
  auto it = departed_.find(host);
  const std::string why = it == departed_.end() || it->second.empty()
                              ? std::string(" (it stopped heartbeating: frozen, cut off or gone)")
                              : absl::StrCat(": ", it->second);
  return absl::UnavailableError(absl::StrCat("host ", host, " left the cluster", why, "; a block of run ",
                                             id.epoch.value(), " it was to send will not come"));
}

Future<BufferPtr> ObjectStore::ExpectTransfer(const std::string& client, const TransferId& id,
                                              const std::string& source_host) {
  std::optional<Promise<BufferPtr>> failed;
  absl::Status why;
  Future<BufferPtr> f;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = transfers_.try_emplace({client, id});
    Transfer& t = it->second;
    if (inserted) t.future = t.promise.future();
    f = t.future;
    t.expected = true;
    t.source_host = source_host;
    if (t.delivered) {
      unclaimed_bytes_ -= t.unclaimed_bytes;
      transfers_.erase(it);
    } else if (departed_.contains(source_host)) {
      failed = std::move(t.promise);
      why = DepartedLocked(source_host, id);
      transfers_.erase(it);
    }
  }
  if (failed) failed->Set(why);  // outside the lock: continuations may run inline
  return f;
}

void ObjectStore::FailAllTransfers(const absl::Status& why) {
  std::vector<Promise<BufferPtr>> failed;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, t] : transfers_) {
      if (!t.delivered) failed.push_back(std::move(t.promise));
    }
    transfers_.clear();
    unclaimed_bytes_ = 0;
  }
  for (auto& p : failed) p.Set(why);  // outside the lock: continuations may run inline
}

int ObjectStore::SetDepartedHosts(absl::flat_hash_map<std::string, std::string> hosts) {
  std::vector<std::pair<Promise<BufferPtr>, absl::Status>> failed;
  {
    absl::MutexLock lock(&mu_);
    departed_ = std::move(hosts);
    if (departed_.empty()) return 0;
    absl::erase_if(transfers_, [&](auto& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      Transfer& t = entry.second;
      if (!t.expected || t.delivered || !departed_.contains(t.source_host)) return false;
      failed.emplace_back(std::move(t.promise), DepartedLocked(t.source_host, entry.first.second));
      return true;
    });
  }
  for (auto& [p, s] : failed) p.Set(s);  // outside the lock: continuations may run inline
  return static_cast<int>(failed.size());
}

void ObjectStore::DeliverTransfer(const std::string& client, const TransferId& id,
                                  absl::StatusOr<BufferPtr> data) {
  Promise<BufferPtr> promise;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = transfers_.try_emplace({client, id});
    Transfer& t = it->second;
    if (inserted) t.future = t.promise.future();
    if (t.delivered) return;  // duplicate delivery: the first one stands
    t.delivered = true;
    promise = std::move(t.promise);
    if (t.expected) {
      transfers_.erase(it);
    } else if (data.ok() && *data != nullptr) {
      t.unclaimed_bytes = (*data)->byte_size();  // held until its consumer comes
      unclaimed_bytes_ += t.unclaimed_bytes;
    }
  }
  promise.Set(std::move(data));  // outside the lock: continuations may run inline
}

namespace {

// Whether the transfer `key` (client, id) goes into nodes first..last of the client's run `epoch`.
bool InRun(const std::pair<std::string, ObjectStore::TransferId>& key, const std::string& client, Epoch epoch,
           int first_node, int last_node) {
  return key.first == client && key.second.epoch == epoch && key.second.node >= first_node &&
         key.second.node <= last_node;
}

}  // namespace

int ObjectStore::FailUndeliveredTransfers(const std::string& client, Epoch epoch, int first_node, int last_node,
                                          const absl::Status& status) {
  std::vector<Promise<BufferPtr>> failed;
  {
    absl::MutexLock lock(&mu_);
    absl::erase_if(transfers_, [&](auto& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      const auto& [key, t] = entry;
      if (!InRun(key, client, epoch, first_node, last_node)) return false;
      if (t.expected && !t.delivered) failed.push_back(std::move(entry.second.promise));
      unclaimed_bytes_ -= t.unclaimed_bytes;
      return true;
    });
  }
  for (auto& p : failed) p.Set(status);  // outside the lock: continuations may run inline
  return static_cast<int>(failed.size());
}

int ObjectStore::FailTransfersForGood(const std::string& client, Epoch epoch, int first_node, int last_node,
                                      const absl::Status& status) {
  std::vector<Promise<BufferPtr>> failed;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [key, t] : transfers_) {
      if (!InRun(key, client, epoch, first_node, last_node) || !t.expected || t.delivered) continue;
      t.delivered = true;  // what comes later is a duplicate: dropped
      failed.push_back(std::move(t.promise));
    }
  }
  for (auto& p : failed) p.Set(status);  // outside the lock: continuations may run inline
  return static_cast<int>(failed.size());
}

std::vector<std::string> ObjectStore::Clients() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> clients;
  for (const auto& [client, arrays] : buffers_) clients.push_back(client);
  return clients;
}

size_t ObjectStore::num_buffers() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [client, arrays] : buffers_) {
    for (const auto& [id, shards] : arrays) n += shards.size();
  }
  return n;
}

int64_t ObjectStore::unclaimed_bytes() const {
  absl::MutexLock lock(&mu_);
  return unclaimed_bytes_;
}

size_t ObjectStore::num_pending_transfers() const {
  absl::MutexLock lock(&mu_);
  return transfers_.size();
}

}  // namespace pathways
