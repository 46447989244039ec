// What the client tests share: a cluster of two islands of one 4-device host each, a client per
// test with slices over it, and helpers for host arrays.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "cluster/local_cluster.h"
#include "gtest/gtest.h"

namespace pathways {

inline HostArray Iota(Shape shape, float scale = 1.0f) {
  HostArray a = *HostArray::Create(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < a.num_elements(); ++i) a.mutable_data<float>()[i] = scale * static_cast<float>(i % 13) - 3.0f;
  return a;
}

inline std::vector<float> Values(const HostArray& a) {
  return std::vector<float>(a.data<float>(), a.data<float>() + a.num_elements());
}

class ClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Two islands of one host with four devices each: small, but every path (same device, same
    // host, another host, another island) is exercised.
    cluster_ = LocalCluster::Start(
                   {.num_islands = 2, .hosts_per_island = 1, .devices_per_host = 4, .device_memory_bytes = 64 << 20})
                   ->release();
  }
  static void TearDownTestSuite() { delete cluster_; }

  void SetUp() override {
    auto client = cluster_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    slice8_ = *client_->CreateSlice({.mesh_shape = {2, 4}, .span_islands = true});
    island0_ = *client_->CreateSlice({.mesh_shape = {4}, .island = 0});
    island1_ = *client_->CreateSlice({.mesh_shape = {4}, .island = 1});
  }

  static inline LocalCluster* cluster_ = nullptr;
  std::unique_ptr<Client> client_;
  VirtualSlice slice8_, island0_, island1_;
};

// How many times `needle` occurs in `haystack`.
inline int Count(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace pathways
