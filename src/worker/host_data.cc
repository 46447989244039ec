// Client data on this host outside runs: puts into the object store, fetches out of it, the
// devices' traces of the client's work, and which clients the host holds anything for.
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/ids.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "transport/rpc_util.h"
#include "worker/host_runtime.h"

namespace pathways {

namespace {

// How long a staged put waits for device memory. Briefly: it comes ahead of the client's earlier
// ops (frees among them), and one that does not fit takes the in-order path instead (gRPC).
constexpr absl::Duration kStagedMemoryWait = absl::Seconds(1);

}  // namespace

absl::Status HostRuntime::CheckNotCollectedLocked(const std::string& client) const {
  if (!collected_.contains(client)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("client ", client, " went away"));
}

absl::StatusOr<BufferPtr> HostRuntime::LandStaged(const rpc::StageRequest& request) {
  {
    absl::MutexLock lock(&programs_mu_);
    PW_RETURN_IF_ERROR(CheckNotCollectedLocked(request.client_id()));
  }
  PW_RETURN_IF_ERROR(CheckDevice(request.local_device()));
  PW_ASSIGN_OR_RETURN(TensorSpec spec, FromProto(request.spec()));
  return devices_[request.local_device()]->Allocate(spec.dtype, spec.shape, kStagedMemoryWait);
}

absl::Status HostRuntime::KeepStaged(const rpc::StageRequest& request, BufferPtr buffer) {
  absl::MutexLock lock(&programs_mu_);
  PW_RETURN_IF_ERROR(CheckNotCollectedLocked(request.client_id()));
  staged_[request.client_id()][{request.dest().array_id(), request.dest().shard()}] = std::move(buffer);
  return absl::OkStatus();
}

BufferPtr HostRuntime::TakeStaged(const std::string& client, const rpc::ShardRef& dest) {
  absl::MutexLock lock(&programs_mu_);
  auto c = staged_.find(client);
  if (c == staged_.end()) return nullptr;
  auto it = c->second.find({dest.array_id(), dest.shard()});
  if (it == c->second.end()) return nullptr;
  BufferPtr staged = std::move(it->second);
  c->second.erase(it);
  if (c->second.empty()) staged_.erase(c);
  return staged;
}

void HostRuntime::Put(const std::string& client, const rpc::PutOp& op) {
  TensorSpec spec = *FromProto(op.spec());
  Promise<BufferPtr> promise;
  store_.Put(client, {ArrayId(op.dest().array_id()), op.dest().shard()}, promise.future());
  // Bytes staged for this dest and sent again in the op (the stream's answer was lost) go too.
  BufferPtr staged = TakeStaged(client, op.dest());
  if (op.staged()) {
    if (staged == nullptr || staged->dtype() != spec.dtype || staged->shape() != spec.shape ||
        staged->device_index() != op.local_device()) {
      promise.Set(absl::DataLossError(absl::StrCat(
          "put of array ", op.dest().array_id(), " shard ", op.dest().shard(), " as ", spec.ToString(), " on device ",
          op.local_device(), ": ", staged == nullptr ? "its bytes were never staged here" : "the staged bytes differ")));
      return;
    }
    promise.Set(std::move(staged));
    return;
  }
  staged.reset();  // freed before the op's own buffer is taken
  auto size = ByteSize(spec.dtype, spec.shape);
  if (static_cast<int64_t>(op.data().size()) != *size) {
    promise.Set(absl::InvalidArgumentError(absl::StrCat("put of ", spec.ToString(), " carries ",
                                                        op.data().size(), " bytes, needs ", *size)));
    return;
  }
  auto buffer = devices_[op.local_device()]->Allocate(spec.dtype, spec.shape);
  if (!buffer.ok()) {
    promise.Set(buffer.status());
    return;
  }
  std::memcpy((*buffer)->data(), op.data().data(), op.data().size());
  promise.Set(*std::move(buffer));
}

void HostRuntime::CountShardFailure(const std::string& client) {
  std::string label = ClientLabel(client);
  absl::MutexLock lock(&failures_mu_);
  if (!failed_shards_.contains(label) && failed_shards_.size() >= kMaxFailureLabels) label = "other";
  ++failed_shards_[label];
}

void HostRuntime::DescribeCounters(rpc::HostCounters* counters) const {
  if (blocks_ != nullptr) {
    const collective::BlockStreams::Counts blocks = blocks_->counts();
    counters->set_blocks_sent(blocks.blocks_sent);
    counters->set_blocks_received(blocks.blocks_received);
    counters->set_block_bytes_sent(blocks.bytes_sent);
    counters->set_block_bytes_received(blocks.bytes_received);
  }
  counters->set_dataflow_bytes_sent(dataflow_transport_.bytes_sent());
  if (options_.dataflow_service != nullptr) {
    counters->set_dataflow_bytes_received(options_.dataflow_service->bytes_received());
  }
  const collective::CollectiveHub::Stats collectives = collectives_.stats();
  counters->set_collectives(collectives.calls);
  counters->set_collectives_failed(collectives.failed);
  for (double bound : collective::CollectiveHub::kLatencyBoundsUs) counters->add_latency_bounds_us(bound);
  for (int64_t n : collectives.latency_buckets) counters->add_latency_buckets(n);
  counters->set_latency_sum_us(collectives.latency_sum_us);
  counters->set_collectives_in_progress(collectives.in_progress);
  counters->set_runs_in_flight(runs_in_flight_.load(std::memory_order_relaxed));
  counters->set_compiled_functions(static_cast<int64_t>(functions_.size()));
  counters->set_compiled_bytes(functions_.held_bytes());
  absl::MutexLock lock(&failures_mu_);
  for (const auto& [label, n] : failed_shards_) {
    rpc::ClientCount* failed = counters->add_failed_shards();
    failed->set_client_id(label);
    failed->set_count(n);
  }
}

rpc::GetTraceResponse HostRuntime::GetTrace(const rpc::GetTraceRequest& request) const {
  rpc::GetTraceResponse response;
  response.set_host(name());
  for (int d = 0; d < num_devices(); ++d) {
    for (const TraceEvent& e : devices_[d]->Trace(request.since_us())) {
      // A client sees its own work only; other tenants' work stays private.
      if (e.label.client != request.client_id()) continue;
      rpc::TraceEventProto* p = response.add_events();
      p->set_device(d);
      p->set_program(e.label.program);
      p->set_run(e.label.run);
      p->set_node(e.label.node);
      p->set_shard(e.label.shard);
      p->set_name(e.label.name);
      p->set_start_us(e.start_us);
      p->set_end_us(e.end_us);
    }
  }
  return response;
}

Future<std::vector<BufferPtr>> HostRuntime::FetchBuffers(const rpc::FetchRequest& request) {
  if (!request.incarnation().empty() && !options_.incarnation.empty() && request.incarnation() != options_.incarnation) {
    return Future<std::vector<BufferPtr>>::Ready(absl::UnavailableError(
        absl::StrCat("host ", name(), " restarted after array ", request.array_id(), " was placed on it; it is gone")));
  }
  if (request.after_seq() > 0) {
    // Read only once the ops that produce the array have been applied here.
    return sequencer_.WhenApplied(request.client_id(), request.session(), request.after_seq())
        .FlatThen([this, request](const Unit&) {
          rpc::FetchRequest now = request;
          now.set_after_seq(0);
          return FetchBuffers(now);
        });
  }
  std::vector<Future<BufferPtr>> shards;
  for (int32_t s : request.shards()) shards.push_back(store_.Get(request.client_id(), {ArrayId(request.array_id()), s}));
  return JoinAll(shards);
}

Future<Unit> HostRuntime::Fetch(const rpc::FetchRequest& request, rpc::FetchResponse* response) {
  Promise<Unit> promise;
  Future<Unit> result = promise.future();
  std::vector<int32_t> indices(request.shards().begin(), request.shards().end());
  bool status_only = request.status_only();
  FetchBuffers(request).OnReady(io_pool_, [promise = std::move(promise), indices, status_only, response](
                                              const absl::StatusOr<std::vector<BufferPtr>>& r) mutable {
    if (!r.ok()) {
      promise.Set(r.status());
      return;
    }
    if (!status_only) {
      for (size_t i = 0; i < r->size(); ++i) {
        const DeviceBuffer& b = *(*r)[i];
        rpc::ShardData* d = response->add_shards();
        d->set_shard(indices[i]);
        *d->mutable_spec() = ToProto(TensorSpec{b.dtype(), b.shape()});
        d->set_data(b.data(), static_cast<size_t>(b.byte_size()));
      }
    }
    promise.Set(Unit{});
  });
  return result;
}

std::vector<std::string> HostRuntime::HeldClients() {
  std::set<std::string> clients;
  for (std::string& c : store_.Clients()) clients.insert(std::move(c));
  for (std::string& c : sequencer_.Clients()) clients.insert(std::move(c));
  for (std::string& c : functions_.Clients()) clients.insert(std::move(c));
  absl::MutexLock lock(&programs_mu_);
  for (const auto& [key, program] : programs_) clients.insert(key.first);
  for (const std::string& c : collected_) clients.erase(c);
  return {clients.begin(), clients.end()};
}

}  // namespace pathways
