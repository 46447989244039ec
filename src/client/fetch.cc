// Reading arrays back: Fetch, Ready and Enqueued, from the hosts that hold the shards, after
// the ops that produce them.
#include <algorithm>
#include <functional>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/client_core.h"
#include "core/status_macros.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

// One replica per distinct region of a sharding: the shards a full read needs.
std::vector<int64_t> DistinctShards(const Sharding& sharding) {
  std::vector<int64_t> shards;
  std::vector<Region> seen;
  for (int64_t s = 0; s < sharding.num_shards(); ++s) {
    Region r = sharding.ShardRegion(s);
    if (std::find(seen.begin(), seen.end(), r) != seen.end()) continue;
    seen.push_back(r);
    shards.push_back(s);
  }
  return shards;
}

// Fetches the given shards from `host` once it has applied op `seq` (which produced them), the
// client's direct ops to it up to `seq` flushed first: that surfaces a refused batch instead of
// waiting for ops that never come. Ops pushed after `seq` (the frees of a loop's old arrays)
// are not waited for: a round trip would otherwise wait for their delivery too.
Future<FetchedShards> FetchFromHost(ClientCore& core, const std::string& host, std::optional<SeqRef> at,
                                         rpc::FetchRequest request, uint64_t max_bytes) {
  std::shared_ptr<WorkerClient> worker = core.worker(host);
  if (!at.has_value()) at = core.LastSeq(host);
  std::shared_ptr<HostOpQueue> queue = core.queue(host);
  if (at->session != queue->session()) {
    // The sequence the array was made in broke (the host died or refused ops); what it held there
    // is gone with it.
    const absl::Status why = core.BreakOf(host, at->session);  // noted when queue() replaced it
    return Future<FetchedShards>::Ready(absl::UnavailableError(
        absl::StrCat("host ", host, " stopped taking this client's ops after array ", request.array_id(),
                     " was made there (it left or restarted", why.ok() ? "" : absl::StrCat(": ", why.ToString()),
                     "); its shards there are gone")));
  }
  request.set_after_seq(at->seq);
  request.set_session(at->session);
  return queue->FlushedThrough(at->seq).FlatThen(
      [worker, request = std::move(request), max_bytes, paths = core.request_paths()](const Unit&) {
        return worker->Fetch(request, max_bytes, paths);
      });
}

// The distinct shards of an array that a full read needs, fetched from their hosts.
Future<std::vector<FetchedShards>> FetchShards(const std::shared_ptr<ClientCore>& core,
                                                    const ShardedArray::State& state,
                                                    const std::vector<int64_t>& shards, bool status_only) {
  std::map<std::string, std::vector<int32_t>> by_host;
  std::map<std::string, std::string> incarnation;
  for (int64_t s : shards) {
    const PhysicalDeviceInfo& d = state.placed_on->devices[s];
    by_host[d.host_address].push_back(static_cast<int32_t>(s));
    incarnation[d.host_address] = d.incarnation;
  }
  // What one shard holds: a worker that says otherwise is not believed (see Assemble).
  const int64_t shard_bytes = ByteSize(state.spec.dtype, state.sharding.local_shape()).value_or(0);
  std::vector<Future<FetchedShards>> responses;
  for (auto& [host, host_shards] : by_host) {
    rpc::FetchRequest request;
    request.set_client_id(core->id());
    request.set_credential(core->credential());
    request.set_array_id(state.id.value());
    request.set_status_only(status_only);
    request.set_incarnation(incarnation[host]);
    for (int32_t s : host_shards) request.add_shards(s);
    const uint64_t max_bytes = host_shards.size() * static_cast<uint64_t>(shard_bytes);
    responses.push_back(FetchFromHost(*core, host, state.ProducedOn(host), std::move(request), max_bytes));
  }
  return JoinAll(responses);
}

std::vector<int64_t> AllShards(const Sharding& sharding) {
  std::vector<int64_t> all(static_cast<size_t>(sharding.num_shards()));
  for (size_t s = 0; s < all.size(); ++s) all[s] = static_cast<int64_t>(s);
  return all;
}


// The array from its distinct shards. The responses are this fetch's own: a shard that is the
// whole array gives its bytes to the result instead of a copy.
absl::StatusOr<HostArray> Assemble(const ShardedArray::State& state, const std::vector<FetchedShards>& all) {
  const Shape& local = state.sharding.local_shape();
  const TensorSpec expected{state.spec.dtype, local};
  std::optional<HostArray> out;
  for (const FetchedShards& response : all) {
    for (rpc::ShardData& shard : *response->mutable_shards()) {
      if (shard.shard() < 0 || shard.shard() >= state.sharding.num_shards()) {
        return absl::InternalError(absl::StrCat("worker returned unknown shard ", shard.shard()));
      }
      PW_ASSIGN_OR_RETURN(TensorSpec got, FromProto(shard.spec()));
      if (got != expected || static_cast<int64_t>(shard.data().size()) != *ByteSize(got.dtype, got.shape)) {
        return absl::InternalError(absl::StrCat("worker returned shard ", shard.shard(), " as ", got.ToString(),
                                                ", expected ", expected.ToString()));
      }
      if (!out.has_value() && local == state.spec.shape) {
        PW_ASSIGN_OR_RETURN(HostArray whole, HostArray::FromBytes(state.spec.dtype, state.spec.shape,
                                                                  std::move(*shard.mutable_data())));
        return whole;
      }
      if (!out.has_value()) {
        PW_ASSIGN_OR_RETURN(HostArray created, HostArray::Create(state.spec.dtype, state.spec.shape));
        out = std::move(created);
      }
      Region region = state.sharding.ShardRegion(shard.shard());
      CopyRegion(shard.data().data(), local, Shape(local.size(), 0), local, DTypeSize(got.dtype),
                 out->mutable_bytes().data(), out->shape(), region.start);
    }
  }
  if (!out.has_value()) return HostArray::Create(state.spec.dtype, state.spec.shape);
  return *std::move(out);
}

// Reads as soon as the array's producing op is pushed (its sequence number on each host is known,
// and each host waits for that op before answering), without first waiting for the controller to
// confirm the op reached its hosts: the read's round trip overlaps the op's. A failed delivery
// fails the read at once with its reason (a refused run says why, not "no shard"), and so does a
// failed read once the delivery is settled.
template <typename T>
Future<T> ReadOncePushed(const std::shared_ptr<const ShardedArray::State>& state, std::function<Future<T>()> read) {
  return state->dispatched.FlatThen([state, read = std::move(read)](const Unit&) {
    struct Race {
      absl::Mutex mu;
      Promise<T> promise ABSL_GUARDED_BY(mu);
    };
    auto race = std::make_shared<Race>();
    Future<T> result;
    {
      absl::MutexLock lock(&race->mu);
      result = race->promise.future();
    }
    auto settle = [race](absl::StatusOr<T> r) {
      Promise<T> p;
      {
        absl::MutexLock lock(&race->mu);
        if (!race->promise.valid()) return;  // the other side came first
        p = std::move(race->promise);
      }
      p.Set(std::move(r));
    };
    state->delivered.OnReady([settle](const absl::StatusOr<Unit>& d) {
      if (!d.ok()) settle(d.status());
    });
    // Holds the state until the answer is in, and lets go before settling: whoever sees the read
    // done and drops the last handle frees the array now, ahead of its next op (not later, on
    // this thread, behind it).
    read().OnReady([held = state, settle](const absl::StatusOr<T>& r) mutable {
      const Future<Unit> delivered = held->delivered;
      held.reset();
      if (r.ok()) {
        settle(r);
        return;
      }
      delivered.OnReady([settle, r](const absl::StatusOr<Unit>& d) { settle(d.ok() ? r : d.status()); });
    });
    return result;
  });
}

}  // namespace

Future<Unit> ShardsReady(const std::shared_ptr<ClientCore>& core,
                         const std::shared_ptr<const ShardedArray::State>& state) {
  // Holding the state keeps the shards alive until the answer is in.
  return FetchShards(core, *state, AllShards(state->sharding), /*status_only=*/true)
      .Then([state](const std::vector<FetchedShards>&) { return Unit{}; });
}

bool Client::Owns(const ShardedArray& array) const {
  return array.state_ != nullptr && array.state_->core.get() == core_.get();
}

absl::Status Client::CheckOwned(const ShardedArray& array, const char* what) const {
  if (!Owns(array)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of an array that is not this client's"));
  }
  if (array.state_->donated.load()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of array ", array.id().value(), ", which was donated to a call and is no longer valid"));
  }
  return absl::OkStatus();
}

void ShardedArray::State::TrackRead(Future<Unit> read) const {
  absl::MutexLock lock(&reads_mu);
  reads.erase(std::remove_if(reads.begin(), reads.end(), [](const Future<Unit>& r) { return r.IsReady(); }),
              reads.end());
  reads.push_back(std::move(read));
}

void ShardedArray::State::AwaitReads() const {
  std::vector<Future<Unit>> pending;
  {
    absl::MutexLock lock(&reads_mu);
    pending.swap(reads);
  }
  for (const Future<Unit>& r : pending) (void)r.Await();  // their errors are their callers'
}

namespace {

// `read`, or, when it failed as a host that went fails it (Unavailable; or Cancelled: a worker
// told it was expelled, as after a freeze past the heartbeat timeout, cancels the calls it serves
// as it leaves) and the controller knows the array's slice lost hosts, Unavailable with the
// controller's reason added: the transport's words ("connection closed", "CANCELLED") do not say
// what happened to the host, the host's own last word to the controller may (a device stuck in a
// computation, say).
template <typename T>
Future<T> WithTheControllersReason(const std::shared_ptr<ClientCore>& core, const ShardedArray::State& state,
                                   Future<T> read) {
  Promise<T> promise;
  Future<T> result = promise.future();
  read.OnReady([core, slice = state.slice.id(), promise = std::move(promise)](const absl::StatusOr<T>& r) mutable {
    if (r.ok() || (!absl::IsUnavailable(r.status()) && !absl::IsCancelled(r.status()))) {
      promise.Set(r);
      return;
    }
    rpc::SliceStatesRequest request;
    request.set_client_id(core->id());
    request.set_credential(core->credential());
    core->controller().SliceStatesAsync(request).OnReady(
        [slice, why = r.status(), promise = std::move(promise)](
            const absl::StatusOr<rpc::SliceStatesResponse>& states) mutable {
          if (states.ok()) {
            for (const rpc::SliceState& s : states->slices()) {
              if (SliceId(s.slice_id()) != slice || !s.lost()) continue;
              promise.Set(absl::UnavailableError(
                  absl::StrCat(why.message(), " (the controller says the array's slice lost hosts: ", s.reason(), ")")));
              return;
            }
          } else if (states.status().code() == absl::StatusCode::kFailedPrecondition) {
            // The controller refuses this client (its computation is why the host left): that is the reason.
            promise.Set(absl::UnavailableError(absl::StrCat(why.message(), " (", states.status().message(), ")")));
            return;
          }
          promise.Set(why);
        });
  });
  return result;
}

}  // namespace

Future<HostArray> Client::Fetch(const ShardedArray& array) {
  if (absl::Status s = CheckOwned(array, "Fetch"); !s.ok()) return Future<HostArray>::Ready(s);
  auto core = core_;
  auto state = array.state_;
  Future<HostArray> fetched =
      ReadOncePushed<std::vector<FetchedShards>>(
          state, [core, state] { return FetchShards(core, *state, DistinctShards(state->sharding), false); })
          .Then([state](const std::vector<FetchedShards>& all) { return Assemble(*state, all); });
  fetched = WithTheControllersReason(core, *state, std::move(fetched));
  state->TrackRead(fetched.Then([](const HostArray&) { return Unit{}; }));
  return fetched;
}

Future<Unit> Client::Enqueued(const ShardedArray& array) {
  if (absl::Status s = CheckOwned(array, "Enqueued"); !s.ok()) return Future<Unit>::Ready(s);
  return array.state_->delivered;
}

Future<Unit> Client::Ready(const ShardedArray& array) {
  if (absl::Status s = CheckOwned(array, "Ready"); !s.ok()) return Future<Unit>::Ready(s);
  auto core = core_;
  auto state = array.state_;
  Future<Unit> ready = WithTheControllersReason(
      core, *state, ReadOncePushed<Unit>(state, [core, state] { return ShardsReady(core, state); }));
  state->TrackRead(ready);
  return ready;
}

}  // namespace pathways
