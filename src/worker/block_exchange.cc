// A program node's block exchange on this host (see NodePlan in worker/program_plan.h): the operators of its
// dataflow graph, and how blocks travel: as buffers to hosts of this process, over the block
// streams (collective/block_streams.h) to other processes, landing in staging buffers. The
// dataflow graph carries a block itself (a TransferRequest behind the receiving shard's index)
// only for a failure or when the host has no streams; a sender's epoch ends only once its
// blocks are in the receivers' stores, so a receiver's epoch end still means every block came.
#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "array/sharding.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "transport/rpc_util.h"
#include "worker/host_runtime.h"

namespace pathways {
namespace {

// The operators of a program node's block exchange (see NodePlan in worker/program_plan.h). The sender
// routes an injected block to the receiving shard named in its first four bytes; the receiver
// hands blocks to the object store and, when its epoch is complete, fails whatever never came.

// Carries nothing: its shard's epoch is closed by the receiving host once it is set up.
class ArmingSource : public dataflow::Operator {
 public:
  void OnMessage(dataflow::ShardContext&, int, int, const std::string&) override {}
  void OnEpochDone(dataflow::ShardContext&) override {}
};

class BlockSender : public dataflow::Operator {
 public:
  explicit BlockSender(int edge) : edge_(edge) {}
  void OnMessage(dataflow::ShardContext& ctx, int, int, const std::string& payload) override {
    int32_t dest = 0;
    std::memcpy(&dest, payload.data(), sizeof(dest));
    ctx.Send(edge_, dest, payload.substr(sizeof(dest)));
  }
  void OnEpochDone(dataflow::ShardContext&) override {}

 private:
  const int edge_;
};

}  // namespace

std::unique_ptr<dataflow::Operator> HostRuntime::MakeBlockSender(int edge) {
  return std::make_unique<BlockSender>(edge);
}

std::unique_ptr<dataflow::Operator> HostRuntime::MakeArmingSource() { return std::make_unique<ArmingSource>(); }

class HostRuntime::BlockReceiver : public dataflow::Operator {
 public:
  BlockReceiver(HostRuntime& runtime, std::string client, int program_node)
      : runtime_(runtime), client_(std::move(client)), program_node_(program_node) {}
  void OnMessage(dataflow::ShardContext& ctx, int, int, const std::string& payload) override {
    rpc::TransferRequest request;
    if (!request.ParseFromString(payload)) {
      // Whose block it was is inside what did not parse: the epoch's end fails every block that
      // did not come, with this as the reason.
      unreadable_[ctx.epoch()] = absl::StrCat("a block of ", payload.size(), " bytes that does not parse reached ",
                                              runtime_.name(), " (dropped)");
      return;
    }
    runtime_.ReceiveTransfer(client_, request);
  }
  void OnEpochDone(dataflow::ShardContext& ctx) override {
    std::string unreadable;
    if (auto it = unreadable_.find(ctx.epoch()); it != unreadable_.end()) {
      unreadable = std::move(it->second);
      unreadable_.erase(it);
    }
    runtime_.FinishEpoch(client_, Epoch(ctx.epoch()), program_node_, unreadable);
  }

 private:
  HostRuntime& runtime_;
  const std::string client_;
  const int program_node_;
  // By epoch, until it ends; an epoch that never ends leaves its entry until the graph (and this
  // operator) goes, one string per epoch at most. One operator per shard, whose callbacks never
  // run concurrently (dataflow::Operator): no lock.
  absl::flat_hash_map<int64_t, std::string> unreadable_;
};

std::unique_ptr<dataflow::Operator> HostRuntime::MakeBlockReceiver(const std::string& client, int program_node) {
  return std::make_unique<BlockReceiver>(*this, client, program_node);
}

namespace {

ObjectStore::TransferId TransferIdOf(const rpc::TransferId& t) {
  return {Epoch(t.epoch()), t.node(), t.input(), t.dst_shard(), t.src_shard()};
}

// The hosts of this process by name: a block for one of them is handed over as a buffer.
absl::Mutex directory_mu(absl::kConstInit);
absl::flat_hash_map<std::string, ObjectStore*>& Directory() ABSL_SHARED_LOCKS_REQUIRED(directory_mu) {
  static auto* directory = new absl::flat_hash_map<std::string, ObjectStore*>();
  return *directory;
}

}  // namespace

void HostRuntime::JoinInProcessDirectory() {
  absl::MutexLock lock(&directory_mu);
  // Another runtime of this process under the same name keeps it (tests that reuse a name).
  in_process_directory_ = Directory().try_emplace(name(), &store_).second;
}

void HostRuntime::LeaveInProcessDirectory() {
  absl::MutexLock lock(&directory_mu);
  if (in_process_directory_) Directory().erase(name());
  in_process_directory_ = false;
}

bool HostRuntime::DeliverInProcess(const std::string& host, const std::string& client,
                                   const ObjectStore::TransferId& id, BufferPtr block) {
  absl::ReaderMutexLock lock(&directory_mu);  // the host stays while it is held
  auto it = Directory().find(host);
  if (it == Directory().end()) return false;
  it->second->DeliverTransfer(client, id, std::move(block));
  return true;
}

rpc::TransferRequest HostRuntime::BlockHeader(const std::string& client, const ObjectStore::TransferId& id) {
  rpc::TransferRequest request;
  request.set_client_id(client);
  rpc::TransferId* t = request.mutable_transfer();
  t->set_epoch(id.epoch.value());
  t->set_node(id.node);
  t->set_input(id.input);
  t->set_dst_shard(id.dst_shard);
  t->set_src_shard(id.src_shard);
  return request;
}

void HostRuntime::SendInline(const std::shared_ptr<HostProgram>& entry, const ObjectStore::TransferId& id,
                             const std::string& dest, const rpc::TransferRequest& request) {
  const NodePlan& exchange = entry->nodes[id.node];
  const int32_t dest_shard = exchange.receiver_index.at(dest);
  std::string payload(sizeof(int32_t), '\0');
  std::memcpy(payload.data(), &dest_shard, sizeof(dest_shard));
  request.AppendToString(&payload);
  absl::Status injected =
      entry->engine->Inject(exchange.send_node, exchange.sender_index.at(name()), id.epoch.value(), std::move(payload));
  if (!injected.ok()) PW_LOG(Error) << "block of epoch " << id.epoch << " not sent: " << injected;
}

void HostRuntime::SendFailure(const std::shared_ptr<HostProgram>& entry, const ObjectStore::TransferId& id,
                              const std::string& dest, const absl::Status& status) {
  rpc::TransferRequest request = BlockHeader(entry->client, id);
  request.set_error_code(static_cast<int>(status.code()));
  request.set_error_message(std::string(status.message()));
  SendInline(entry, id, dest, request);
}

Future<Unit> HostRuntime::Send(const std::shared_ptr<HostProgram>& entry, ObjectStore::ShardKey source,
                               const Region& region, const std::string& dest, const ObjectStore::TransferId& id) {
  Promise<Unit> handed;
  Future<Unit> result = handed.future();
  store_.Get(entry->client, source)
      .OnReady(io_pool_, [this, entry, region, dest, id, handed = std::move(handed)](
                             const absl::StatusOr<BufferPtr>& src) mutable {
        absl::Status status = src.status();
        if (status.ok()) status = CheckRegionInside(region, (*src)->shape());
        if (!status.ok()) {
          SendFailure(entry, id, dest, absl::Status(status.code(), absl::StrCat("from host ", name(), ": ", status.message())));
          handed.Set(Unit{});
          return;
        }
        const BufferPtr& b = *src;
        const size_t element = DTypeSize(b->dtype());
        const int64_t bytes = *ByteSize(b->dtype(), region.size);
        const bool crosses_dcn = dcn_ != nullptr && dcn_->Crosses(dest);
        const auto span = ContiguousSpan(b->shape(), region);
        // Only the part the receiver needs, copied once, when it is not one run of the buffer.
        auto copy_region = [&](std::shared_ptr<MemoryBudget> budget) {
          auto part = std::make_shared<DeviceBuffer>(std::move(budget), -1, b->dtype(), region.size, bytes);
          CopyRegion(b->data(), b->shape(), region.start, region.size, element, part->data(), region.size,
                     Shape(region.size.size(), 0));
          return part;
        };
        // A host of this process gets the buffer itself (it is only read: the consumer copies it
        // into its device), or the part it needs.
        if (!crosses_dcn) {
          BufferPtr block = span.has_value() && span->second * static_cast<int64_t>(element) == b->byte_size()
                                ? b
                                : copy_region(std::make_shared<MemoryBudget>(dest + "/staging", bytes));
          if (DeliverInProcess(dest, entry->client, id, std::move(block))) {
            handed.Set(Unit{});
            return;
          }
        }
        if (blocks_ != nullptr) {
          rpc::TransferRequest header = BlockHeader(entry->client, id);
          *header.mutable_spec() = ToProto(TensorSpec{b->dtype(), region.size});
          std::shared_ptr<const void> keep = b;
          const char* data = b->data();
          if (span.has_value()) {
            data += span->first * static_cast<int64_t>(element);
          } else {
            auto part = copy_region(std::make_shared<MemoryBudget>(name() + "/outgoing", bytes));
            data = part->data();
            keep = std::move(part);
          }
          blocks_->Send(dest, header.SerializeAsString(), data, static_cast<uint64_t>(bytes), std::move(keep),
                        [this, entry, id, dest, handed = std::make_shared<Promise<Unit>>(std::move(handed))](
                            absl::Status s) {
                          if (!s.ok()) SendFailure(entry, id, dest, s);
                          handed->Set(Unit{});
                        });
          return;
        }
        rpc::TransferRequest request = BlockHeader(entry->client, id);
        *request.mutable_spec() = ToProto(TensorSpec{b->dtype(), region.size});
        std::string* data = request.mutable_data();
        data->resize(static_cast<size_t>(bytes));
        CopyRegion(b->data(), b->shape(), region.start, region.size, element, data->data(), region.size,
                   Shape(region.size.size(), 0));
        SendInline(entry, id, dest, request);
        handed.Set(Unit{});
      });
  return result;
}

absl::StatusOr<collective::BlockStreams::Landing> HostRuntime::LandBlock(const std::string& from,
                                                                         const std::string& header,
                                                                         uint64_t bytes) {
  rpc::TransferRequest request;
  if (!request.ParseFromString(header)) {
    return absl::InvalidArgumentError(absl::StrCat("a block from ", from, " whose header does not parse"));
  }
  const rpc::TransferId& t = request.transfer();
  PW_ASSIGN_OR_RETURN(TensorSpec spec, FromProto(request.spec()));
  PW_ASSIGN_OR_RETURN(int64_t size, ByteSize(spec.dtype, spec.shape));
  if (static_cast<uint64_t>(size) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a block from ", from, " carries ", bytes, " bytes for ", spec.ToString()));
  }
  // No device here could take a larger input; and blocks that wait for their consumer are held
  // up to what this host's devices could take at once (a peer cannot fill the host's memory
  // with blocks nobody asked for).
  if (size > options_.device_memory_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("a block of ", size, " bytes from ", from,
                                                     " exceeds the device memory of ", name()));
  }
  const int64_t hold_limit = options_.device_memory_bytes * std::max(1, options_.num_devices);
  if (const int64_t held = store_.unclaimed_bytes(); held + size > hold_limit) {
    return absl::ResourceExhaustedError(absl::StrCat(name(), " already holds ", held, " bytes of blocks no run has claimed yet; a block of ",
                                                     size, " bytes from ", from, " would pass its limit of ", hold_limit));
  }
  // Staged in host memory: charged to a device only when the consuming computation assembles its
  // input there.
  auto staging = std::make_shared<MemoryBudget>(name() + "/staging", size);
  (void)staging->Charge(size);
  auto buffer = std::make_shared<DeviceBuffer>(staging, -1, spec.dtype, spec.shape, size);
  const ObjectStore::TransferId id = TransferIdOf(t);
  return collective::BlockStreams::Landing{
      buffer->data(), [this, client = request.client_id(), id, buffer](absl::Status s) {
        store_.DeliverTransfer(client, id, s.ok() ? absl::StatusOr<BufferPtr>(buffer) : s);
      }};
}

void HostRuntime::ReceiveTransfer(const std::string& client, const rpc::TransferRequest& request) {
  const rpc::TransferId& t = request.transfer();
  auto deliver = [&](absl::StatusOr<BufferPtr> data) {
    store_.DeliverTransfer(client, TransferIdOf(t), std::move(data));
  };
  if (request.error_code() != 0) {
    deliver(absl::Status(static_cast<absl::StatusCode>(request.error_code()), request.error_message()));
    return;
  }
  auto spec = FromProto(request.spec());
  if (!spec.ok()) {
    deliver(spec.status());
    return;
  }
  // A transferred block is staged in host memory: it is charged to a device only when the
  // consuming computation assembles its input there.
  auto size = ByteSize(spec->dtype, spec->shape);
  if (static_cast<int64_t>(request.data().size()) != *size) {
    deliver(absl::InvalidArgumentError(absl::StrCat("transfer of epoch ", t.epoch(), " carries ",
                                                    request.data().size(), " bytes for ",
                                                    spec->ToString())));
    return;
  }
  auto staging = std::make_shared<MemoryBudget>(name() + "/staging", *size);
  (void)staging->Charge(*size);
  auto buffer = std::make_shared<DeviceBuffer>(staging, -1, spec->dtype, spec->shape, *size);
  std::memcpy(buffer->data(), request.data().data(), request.data().size());
  deliver(std::move(buffer));
}

}  // namespace pathways
