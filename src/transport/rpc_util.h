// Conversions between runtime types and their wire form.
#pragma once

#include "absl/status/status.h"
#include "array/sharding.h"
#include "core/types.h"
#include "grpcpp/support/status.h"
#include "proto/pathways.pb.h"

namespace pathways {

grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);
// Prefixes a failed call's status with what was being done and with whom.
absl::Status FromGrpc(const grpc::Status& status, const std::string& what);

rpc::TensorSpecProto ToProto(const TensorSpec& spec);
// Validates the dtype and the shape (non-negative, bounded size).
absl::StatusOr<TensorSpec> FromProto(const rpc::TensorSpecProto& proto);

rpc::RegionProto ToProto(const Region& region);
Region FromProto(const rpc::RegionProto& proto);

}  // namespace pathways
