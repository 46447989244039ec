// The dataflow engine across processes: long-lived gRPC streams, one per (sending host,
// receiving host), carrying batches of envelopes in order.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "dataflow/engine.h"
#include "proto/pathways.grpc.pb.h"

namespace pathways::dataflow {

// Sends batches to other hosts' DataflowService. Thread-safe. Each peer gets one stream and one
// sender thread; batches queued while a write is in progress go out merged into one message.
class GrpcTransport : public Transport {
 public:
  GrpcTransport(std::string graph, std::string self_host);
  ~GrpcTransport() override;  // finishes every stream
  void Send(const std::string& host, std::vector<Envelope> batch) override;
  // Batches written to the network; fewer than Send calls when batches merged.
  int64_t messages_written() const;

 private:
  class PeerStream;
  const std::string graph_;
  const std::string self_host_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<PeerStream>> peers_ ABSL_GUARDED_BY(mu_);
};

// Receives batches for the engines registered with it (by graph name) and hands them over.
// Thread-safe once the engines are added.
class DataflowService final : public rpc::Dataflow::Service {
 public:
  void AddEngine(Engine* engine);
  grpc::Status Stream(grpc::ServerContext* context, grpc::ServerReader<rpc::DataflowBatch>* reader,
                      rpc::DataflowAck* ack) override;

 private:
  absl::Mutex mu_;
  std::map<std::string, Engine*> engines_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways::dataflow
