#include "testing/request_fuzzer.h"

#include "absl/time/time.h"
#include "google/protobuf/stubs/logging.h"
#include "worker/lowered_program.h"

namespace pathways {
namespace {

enum Kind : uint8_t {
  kEnqueue, kFetch, kAllocateSlice, kRegisterWorker, kScheduled, kProgram, kHeartbeat, kControlGraph, kKinds
};

// Keeps a fuzzed program on this host: blocks would otherwise go to whatever hosts it names.
void StayLocal(rpc::ProgramProto& program) {
  for (auto& slice : *program.mutable_slices()) {
    for (auto& device : *slice.mutable_devices()) device.set_host_address(RequestFuzzer::kHost);
  }
}

}  // namespace

RequestFuzzer::RequestFuzzer() : registry_(absl::Seconds(3)) {
  // Invalid UTF-8 in string fields is an expected rejection here, not news.
  google::protobuf::SetLogHandler(nullptr);
  HostRuntimeOptions options;
  options.num_devices = 2;
  options.device_memory_bytes = int64_t{1} << 20;
  options.name = kHost;
  options.dataflow_service = &dataflow_;
  options.memory_wait = absl::ZeroDuration();  // nothing frees memory here; fail at once
  options.collective_timeout = absl::Milliseconds(10);
  runtime_ = std::make_unique<HostRuntime>(options);
}

void RequestFuzzer::Feed(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const Kind kind = static_cast<Kind>(data[0] % kKinds);
  const void* payload = data + 1;
  const int length = static_cast<int>(size - 1);
  const absl::Time now = absl::UnixEpoch() + absl::Seconds(1);
  switch (kind) {
    case kEnqueue:
      Decode<rpc::EnqueueRequest>(payload, length, [&](rpc::EnqueueRequest& request) {
        for (auto& op : *request.mutable_ops()) {
          if (op.has_register_program()) StayLocal(*op.mutable_register_program()->mutable_program());
        }
        (void)runtime_->Enqueue(request);
      });
      return;
    case kFetch:
      Decode<rpc::FetchRequest>(payload, length, [&](rpc::FetchRequest& request) {
        request.set_after_seq(0);  // waiting for ops that never come is allowed, not useful here
        // The response lives until the fetch is done, however long the fuzzer waits.
        auto response = std::make_shared<rpc::FetchResponse>();
        Future<Unit> done = runtime_->Fetch(request, response.get());
        done.OnReady([response](const absl::StatusOr<Unit>&) {});
        (void)done.AwaitFor(absl::Milliseconds(5));
      });
      return;
    case kAllocateSlice:
      Decode<rpc::AllocateSliceRequest>(payload, length,
                                        [&](auto& request) { (void)registry_.AllocateSlice(request, now); });
      return;
    case kRegisterWorker:
      Decode<rpc::RegisterWorkerRequest>(payload, length,
                                         [&](auto& request) { (void)registry_.RegisterWorker(request, now); });
      return;
    case kScheduled:
      Decode<rpc::ScheduledBatch>(payload, length, [&](auto& batch) {
        (void)runtime_->ApplyScheduled(std::vector<rpc::ScheduledOp>(batch.ops().begin(), batch.ops().end()));
      });
      return;
    case kProgram:
      Decode<rpc::ProgramProto>(payload, length, [&](rpc::ProgramProto& program) {
        StayLocal(program);
        (void)LoweredProgram::Create(program, kHost, runtime_->num_devices());
      });
      return;
    case kHeartbeat:
      Decode<rpc::HeartbeatRequest>(payload, length, [&](auto& request) {
        (void)registry_.Heartbeat(request, now);
        (void)registry_.Status(now);
      });
      return;
    case kControlGraph:
      Decode<rpc::ControlGraph>(payload, length, [&](rpc::ControlGraph& graph) {
        // The controller's shards stay here too: reports must not go to fuzzed addresses.
        graph.set_controller(kHost);
        if (graph.hosts().empty()) graph.add_hosts(kHost);
        (void)runtime_->JoinControlGraph(graph);
      });
      return;
    case kKinds:
      return;
  }
}

}  // namespace pathways
