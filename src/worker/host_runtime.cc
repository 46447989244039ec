#include "worker/host_runtime.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "array/sharding.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "device/cpu_device.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

constexpr int kMaxDevices = 4096;

// One input of one shard: its local spec and the futures of the blocks it is assembled from.
struct InputPlan {
  TensorSpec spec;
  std::vector<Region> src_regions;
  std::vector<Shape> dst_starts;
  size_t first_piece = 0;  // index into the flattened piece futures
};

absl::Status CheckSameRank(const Region& region, const Shape& dst_start, size_t rank) {
  if (region.start.size() != rank || region.size.size() != rank || dst_start.size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat("input piece of rank ", region.start.size(),
                                                   " does not match input rank ", rank));
  }
  return absl::OkStatus();
}

// Builds one input on `device` from its pieces. When the input is exactly one whole local buffer
// on the same device it is used as is, without a copy.
absl::StatusOr<BufferPtr> AssembleInput(Device& device, const InputPlan& plan,
                                        const std::vector<BufferPtr>& pieces) {
  const size_t n = plan.src_regions.size();
  for (size_t p = 0; p < n; ++p) {
    const BufferPtr& src = pieces[plan.first_piece + p];
    if (src->dtype() != plan.spec.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("input is ", DTypeName(src->dtype()),
                                                     ", expected ", plan.spec.ToString()));
    }
    PW_RETURN_IF_ERROR(CheckSameRank(plan.src_regions[p], plan.dst_starts[p], plan.spec.shape.size()));
    PW_RETURN_IF_ERROR(CheckRegionInside(plan.src_regions[p], src->shape()));
    PW_RETURN_IF_ERROR(CheckRegionInside({plan.dst_starts[p], plan.src_regions[p].size}, plan.spec.shape));
  }
  if (n == 1) {
    const BufferPtr& only = pieces[plan.first_piece];
    if (only->device_index() == device.local_index() && only->shape() == plan.spec.shape &&
        plan.src_regions[0].size == plan.spec.shape) {
      return only;
    }
  }
  PW_ASSIGN_OR_RETURN(BufferPtr out, device.Allocate(plan.spec.dtype, plan.spec.shape));
  if (n == 0) std::memset(out->data(), 0, static_cast<size_t>(out->byte_size()));
  for (size_t p = 0; p < n; ++p) {
    const BufferPtr& src = pieces[plan.first_piece + p];
    CopyRegion(src->data(), src->shape(), plan.src_regions[p].start, plan.src_regions[p].size,
               DTypeSize(src->dtype()), out->data(), plan.spec.shape, plan.dst_starts[p]);
  }
  return out;
}

}  // namespace

HostRuntime::HostRuntime(HostRuntimeOptions options)
    : options_(std::move(options)), io_pool_(options_.name + "-io", 2) {
  ConfigureComputeThreads(options_.intra_op_threads);
  for (int i = 0; i < options_.num_devices; ++i) {
    devices_.push_back(std::make_unique<CpuDevice>(i, options_.device_memory_bytes, options_.name));
  }
}

// Work moves between the I/O pool and the device streams in both directions, so both are
// stopped (draining what is queued) before either is destroyed; work that arrives later is
// dropped, which cancels its futures.
HostRuntime::~HostRuntime() {
  io_pool_.Shutdown();
  for (auto& d : devices_) d->Shutdown();
}

absl::StatusOr<std::string> HostRuntime::Compile(const rpc::FunctionBodyProto& proto) {
  if (proto.kind() != static_cast<int>(FunctionBody::Kind::kTorchScript) &&
      proto.kind() != static_cast<int>(FunctionBody::Kind::kBuiltin)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown function body kind ", proto.kind()));
  }
  FunctionBody body{static_cast<FunctionBody::Kind>(proto.kind()), proto.name(), proto.source()};
  PW_ASSIGN_OR_RETURN(auto exe, functions_.Compile(body));
  (void)exe;
  return FunctionKey(body);
}

absl::Status HostRuntime::ValidateOp(const rpc::Op& op) const {
  auto check_device = [&](int32_t d) -> absl::Status {
    if (d < 0 || d >= num_devices()) {
      return absl::InvalidArgumentError(
          absl::StrCat("device ", d, " does not exist on ", name(), " (", num_devices(), " devices)"));
    }
    return absl::OkStatus();
  };
  switch (op.kind_case()) {
    case rpc::Op::kExecute: {
      const auto& e = op.execute();
      if (e.output_array_ids_size() != e.output_specs_size()) {
        return absl::InvalidArgumentError("execute op: output ids and specs differ in number");
      }
      for (const auto& spec : e.output_specs()) PW_RETURN_IF_ERROR(FromProto(spec).status());
      for (const auto& shard : e.shards()) {
        PW_RETURN_IF_ERROR(check_device(shard.local_device()));
        for (const auto& input : shard.inputs()) PW_RETURN_IF_ERROR(FromProto(input.spec()).status());
      }
      return absl::OkStatus();
    }
    case rpc::Op::kSend:
      if (op.send().dest_address().empty()) return absl::InvalidArgumentError("send op without a destination");
      return absl::OkStatus();
    case rpc::Op::kPut:
      PW_RETURN_IF_ERROR(check_device(op.put().local_device()));
      return FromProto(op.put().spec()).status();
    case rpc::Op::kFree:
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError("op of unknown kind");
  }
}

absl::Status HostRuntime::Enqueue(const rpc::EnqueueRequest& request) {
  if (request.client_id().empty()) return absl::InvalidArgumentError("request has no client id");
  // Validate the whole batch first, so a malformed batch is rejected without being half-applied.
  for (int i = 0; i < request.ops_size(); ++i) {
    absl::Status s = ValidateOp(request.ops(i));
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("op ", i, ": ", s.message()));
  }
  const std::string& client = request.client_id();
  for (const rpc::Op& op : request.ops()) {
    switch (op.kind_case()) {
      case rpc::Op::kExecute: Execute(client, op.execute()); break;
      case rpc::Op::kSend: Send(client, op.send()); break;
      case rpc::Op::kPut: Put(client, op.put()); break;
      case rpc::Op::kFree: store_.FreeArray(client, op.free().array_id()); break;
      default: break;
    }
  }
  return absl::OkStatus();
}

void HostRuntime::Execute(const std::string& client, const rpc::ExecuteOp& op) {
  std::shared_ptr<const Executable> exe = functions_.Lookup(op.function_key());
  std::vector<TensorSpec> out_specs;
  for (const auto& spec : op.output_specs()) out_specs.push_back(*FromProto(spec));

  for (const rpc::ShardExecution& shard : op.shards()) {
    // Output entries exist from now on, so later ops can consume them before they are computed.
    auto outputs = std::make_shared<std::vector<Promise<BufferPtr>>>(out_specs.size());
    for (size_t j = 0; j < out_specs.size(); ++j) {
      store_.Put(client, {op.output_array_ids(j), shard.shard()}, (*outputs)[j].future());
    }
    auto fail = [outputs](const absl::Status& s) {
      for (auto& p : *outputs) p.Set(s);
    };
    if (exe == nullptr) {
      fail(absl::NotFoundError(absl::StrCat("function '", op.function_name(),
                                            "' is not compiled on host ", name())));
      continue;
    }
    auto plans = std::make_shared<std::vector<InputPlan>>();
    std::vector<Future<BufferPtr>> piece_futures;
    for (const rpc::ShardInput& input : shard.inputs()) {
      InputPlan plan;
      plan.spec = *FromProto(input.spec());
      plan.first_piece = piece_futures.size();
      for (const rpc::InputPiece& piece : input.pieces()) {
        if (piece.has_local()) {
          piece_futures.push_back(
              store_.Get(client, {piece.local().array_id(), piece.local().shard()}));
        } else {
          piece_futures.push_back(store_.ExpectTransfer(client, piece.transfer_key()));
        }
        plan.src_regions.push_back(FromProto(piece.src_region()));
        plan.dst_starts.emplace_back(piece.dst_start().begin(), piece.dst_start().end());
      }
      plans->push_back(std::move(plan));
    }
    Device* device = devices_[shard.local_device()].get();
    std::string function_name = op.function_name();
    int32_t shard_index = shard.shard();
    JoinAll(piece_futures)
        .OnReady([device, exe, plans, outputs, out_specs, function_name, shard_index,
                  fail](const absl::StatusOr<std::vector<BufferPtr>>& pieces) {
          if (!pieces.ok()) {
            fail(absl::Status(pieces.status().code(),
                              absl::StrCat("input of '", function_name, "' (shard ", shard_index,
                                           "): ", pieces.status().message())));
            return;
          }
          device->Enqueue([device, exe, plans, outputs, out_specs, function_name, shard_index,
                           fail, pieces = *pieces]() {
            auto run = [&]() -> absl::StatusOr<std::vector<BufferPtr>> {
              std::vector<BufferPtr> inputs;
              for (size_t i = 0; i < plans->size(); ++i) {
                auto in = AssembleInput(*device, (*plans)[i], pieces);
                if (!in.ok()) {
                  return absl::Status(in.status().code(),
                                      absl::StrCat("function '", function_name, "' input ", i,
                                                   " (shard ", shard_index, "): ",
                                                   in.status().message()));
                }
                inputs.push_back(*std::move(in));
              }
              std::vector<BufferPtr> results;
              for (const TensorSpec& spec : out_specs) {
                PW_ASSIGN_OR_RETURN(BufferPtr out, device->Allocate(spec.dtype, spec.shape));
                results.push_back(std::move(out));
              }
              std::vector<const DeviceBuffer*> in_ptrs;
              for (auto& b : inputs) in_ptrs.push_back(b.get());
              std::vector<DeviceBuffer*> out_ptrs;
              for (auto& b : results) out_ptrs.push_back(b.get());
              PW_RETURN_IF_ERROR(exe->Run(in_ptrs, out_ptrs));
              return results;
            };
            auto results = run();
            if (!results.ok()) {
              fail(results.status());
              return;
            }
            for (size_t j = 0; j < results->size(); ++j) (*outputs)[j].Set((*results)[j]);
          });
        });
  }
}

void HostRuntime::Send(const std::string& client, const rpc::SendOp& op) {
  Region region = FromProto(op.region());
  std::string dest = op.dest_address();
  TransferKey key = op.transfer_key();
  store_.Get(client, {op.source().array_id(), op.source().shard()})
      .OnReady(io_pool_, [this, client, region, dest, key](const absl::StatusOr<BufferPtr>& src) {
        rpc::TransferRequest request;
        request.set_client_id(client);
        request.set_transfer_key(key);
        absl::Status status = src.status();
        if (status.ok()) status = CheckRegionInside(region, (*src)->shape());
        if (status.ok()) {
          const DeviceBuffer& b = **src;
          *request.mutable_spec() = ToProto(TensorSpec{b.dtype(), region.size});
          std::string* data = request.mutable_data();
          data->resize(static_cast<size_t>(*ByteSize(b.dtype(), region.size)));
          CopyRegion(b.data(), b.shape(), region.start, region.size, DTypeSize(b.dtype()),
                     data->data(), region.size, Shape(region.size.size(), 0));
        } else {
          request.set_error_code(static_cast<int>(status.code()));
          request.set_error_message(absl::StrCat("from host ", name(), ": ", status.message()));
        }
        if (dest == address_) {
          ReceiveTransfer(request);
          return;
        }
        WorkerClientCache::Global().Get(dest)->Transfer(request).OnReady(
            [dest, key](const absl::StatusOr<rpc::TransferResponse>& r) {
              if (!r.ok()) PW_LOG(Warning) << "transfer " << key << " to " << dest << " failed: " << r.status();
            });
      });
}

void HostRuntime::ReceiveTransfer(const rpc::TransferRequest& request) {
  auto deliver = [&](absl::StatusOr<BufferPtr> data) {
    store_.DeliverTransfer(request.client_id(), request.transfer_key(), std::move(data));
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
    deliver(absl::InvalidArgumentError(absl::StrCat("transfer ", request.transfer_key(), " carries ",
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

void HostRuntime::Put(const std::string& client, const rpc::PutOp& op) {
  TensorSpec spec = *FromProto(op.spec());
  Promise<BufferPtr> promise;
  store_.Put(client, {op.dest().array_id(), op.dest().shard()}, promise.future());
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

Future<rpc::FetchResponse> HostRuntime::Fetch(const rpc::FetchRequest& request) {
  std::vector<Future<BufferPtr>> shards;
  for (int32_t s : request.shards()) shards.push_back(store_.Get(request.client_id(), {request.array_id(), s}));
  Promise<rpc::FetchResponse> promise;
  Future<rpc::FetchResponse> result = promise.future();
  std::vector<int32_t> indices(request.shards().begin(), request.shards().end());
  bool status_only = request.status_only();
  JoinAll(shards).OnReady(io_pool_, [promise = std::move(promise), indices, status_only](
                                         const absl::StatusOr<std::vector<BufferPtr>>& r) mutable {
    if (!r.ok()) {
      promise.Set(r.status());
      return;
    }
    rpc::FetchResponse response;
    if (!status_only) {
      for (size_t i = 0; i < r->size(); ++i) {
        const DeviceBuffer& b = *(*r)[i];
        rpc::ShardData* d = response.add_shards();
        d->set_shard(indices[i]);
        *d->mutable_spec() = ToProto(TensorSpec{b.dtype(), b.shape()});
        d->set_data(b.data(), static_cast<size_t>(b.byte_size()));
      }
    }
    promise.Set(std::move(response));
  });
  return result;
}

}  // namespace pathways
