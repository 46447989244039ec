// A program node's block exchange on this host (see HostRuntime::NodePlan): the operators of its
// dataflow graph, and the blocks' wire format (a TransferRequest behind the receiving shard's
// index), sent from the object store and received into staging buffers.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "transport/rpc_util.h"
#include "worker/host_runtime.h"

namespace pathways {
namespace {

// The operators of a program node's block exchange (see HostRuntime::NodePlan). The sender
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
  void OnMessage(dataflow::ShardContext&, int, int, const std::string& payload) override {
    rpc::TransferRequest request;
    if (!request.ParseFromString(payload)) {
      PW_LOG(Error) << "dataflow block that does not parse, dropped";
      return;
    }
    runtime_.ReceiveTransfer(client_, request);
  }
  void OnEpochDone(dataflow::ShardContext& ctx) override { runtime_.FinishEpoch(client_, ctx.epoch(), program_node_); }

 private:
  HostRuntime& runtime_;
  const std::string client_;
  const int program_node_;
};

std::unique_ptr<dataflow::Operator> HostRuntime::MakeBlockReceiver(const std::string& client, int program_node) {
  return std::make_unique<BlockReceiver>(*this, client, program_node);
}

Future<Unit> HostRuntime::Send(const std::shared_ptr<Program>& entry, ObjectStore::ShardKey source,
                               const Region& region, const std::string& dest, const ObjectStore::TransferId& id) {
  const NodePlan& exchange = entry->nodes[id.node];
  const int32_t dest_shard = exchange.receiver_index.at(dest);
  const int sender_shard = exchange.sender_index.at(name());
  Promise<Unit> handed;
  Future<Unit> result = handed.future();
  store_.Get(entry->client, source)
      .OnReady(io_pool_, [this, entry, region, dest_shard, sender_shard, id, handed = std::move(handed)](
                             const absl::StatusOr<BufferPtr>& src) mutable {
        rpc::TransferRequest request;
        request.set_client_id(entry->client);
        rpc::TransferId* t = request.mutable_transfer();
        t->set_epoch(id.epoch);
        t->set_node(id.node);
        t->set_input(id.input);
        t->set_dst_shard(id.dst_shard);
        t->set_src_shard(id.src_shard);
        absl::Status status = src.status();
        if (status.ok()) status = CheckRegionInside(region, (*src)->shape());
        if (status.ok()) {
          const DeviceBuffer& b = **src;
          *request.mutable_spec() = ToProto(TensorSpec{b.dtype(), region.size});
          std::string* data = request.mutable_data();
          data->resize(static_cast<size_t>(*ByteSize(b.dtype(), region.size)));
          CopyRegion(b.data(), b.shape(), region.start, region.size, DTypeSize(b.dtype()), data->data(),
                     region.size, Shape(region.size.size(), 0));
        } else {
          // The consumer fails with the producer's error instead of waiting for data.
          request.set_error_code(static_cast<int>(status.code()));
          request.set_error_message(absl::StrCat("from host ", name(), ": ", status.message()));
        }
        std::string payload(sizeof(int32_t), '\0');
        std::memcpy(payload.data(), &dest_shard, sizeof(dest_shard));
        request.AppendToString(&payload);
        absl::Status injected = entry->engine->Inject(entry->nodes[id.node].send_node, sender_shard, id.epoch,
                                                      std::move(payload));
        if (!injected.ok()) PW_LOG(Error) << "block of epoch " << id.epoch << " not sent: " << injected;
        handed.Set(Unit{});
      });
  return result;
}

void HostRuntime::ReceiveTransfer(const std::string& client, const rpc::TransferRequest& request) {
  const rpc::TransferId& t = request.transfer();
  auto deliver = [&](absl::StatusOr<BufferPtr> data) {
    store_.DeliverTransfer(client, {t.epoch(), t.node(), t.input(), t.dst_shard(), t.src_shard()}, std::move(data));
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
