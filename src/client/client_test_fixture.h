// What the client tests share: a cluster per test suite and a client per test (LocalClusterTest);
// for most, two islands of one 4-device host each with slices over them (ClientTest); helpers for
// host arrays.
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

// A cluster started once for a test suite (its SetUpTestSuite calls StartCluster), and a client of
// it for each test.
class LocalClusterTest : public ::testing::Test {
 protected:
  static void StartCluster(const LocalClusterOptions& options) {
    auto cluster = LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(cluster_, nullptr) << "the suite's cluster did not start";
    auto client = cluster_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  static inline LocalCluster* cluster_ = nullptr;
  std::unique_ptr<Client> client_;
};

class ClientTest : public LocalClusterTest {
 protected:
  static void SetUpTestSuite() {
    // Two islands of one host with four devices each: small, but every path (same device, same
    // host, another host, another island) is exercised.
    StartCluster({.num_islands = 2, .hosts_per_island = 1, .devices_per_host = 4, .device_memory_bytes = 64 << 20});
  }

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(LocalClusterTest::SetUp());
    slice8_ = *client_->CreateSlice({.mesh_shape = {2, 4}, .span_islands = true});
    island0_ = *client_->CreateSlice({.mesh_shape = {4}, .island = 0});
    island1_ = *client_->CreateSlice({.mesh_shape = {4}, .island = 1});
  }

  VirtualSlice slice8_, island0_, island1_;
};

// How many times `needle` occurs in `haystack`.
inline int Count(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace pathways
