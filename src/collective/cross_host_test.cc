// The cross-host algorithms, H hosts as threads in one process over real loopback connections,
// for group sizes that are and are not powers of two and for messages on both sides of the
// small/large threshold. The mesh under them (its failures, ordering and security) is tested in
// peer_mesh_test.cc.
#include "collective/cross_host.h"

#include <cstring>
#include <limits>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"
#include "collective/loopback_hosts.h"
#include "core/status_macros.h"
#include "gtest/gtest.h"

namespace pathways::collective {
namespace {

// Host h's value at element i: distinct per host and element, exact in float.
float Value(int h, size_t i) { return static_cast<float>((h + 1) * 1000 + i % 997); }

class CrossHostTest : public ::testing::TestWithParam<std::tuple<int /*hosts*/, size_t /*elements*/>> {};

TEST_P(CrossHostTest, AllReduceSumsAndEveryHostGetsTheSameBits) {
  const int n = std::get<0>(GetParam());
  const size_t count = std::get<1>(GetParam());
  Hosts hosts(n);
  std::vector<std::vector<float>> data(n, std::vector<float>(count));
  for (int h = 0; h < n; ++h) {
    for (size_t i = 0; i < count; ++i) data[h][i] = Value(h, i) + 0.1f * h;
  }
  ExpectAllOk(hosts.Run("k", 1, [&](int h, MeshSteps& s) {
    // Half the hosts reduce in place, half from a separate input.
    if (h % 2 == 0) {
      char* p = reinterpret_cast<char*>(data[h].data());
      return AllReduceAcrossHosts(s, DType::kF32, ReduceOp::kSum, p, p, count);
    }
    const std::vector<float> in = data[h];
    return AllReduceAcrossHosts(s, DType::kF32, ReduceOp::kSum, reinterpret_cast<const char*>(in.data()),
                                reinterpret_cast<char*>(data[h].data()), count);
  }));
  for (size_t i = 0; i < count; i += std::max<size_t>(1, count / 100)) {
    double want = 0;
    for (int h = 0; h < n; ++h) want += Value(h, i) + 0.1f * h;
    EXPECT_NEAR(data[0][i], want, 1e-2 * n) << "element " << i;
  }
  for (int h = 1; h < n; ++h) {
    EXPECT_EQ(std::memcmp(data[h].data(), data[0].data(), count * sizeof(float)), 0) << "host " << h;
  }
}

TEST_P(CrossHostTest, MaxOverIntegers) {
  const int n = std::get<0>(GetParam());
  const size_t count = std::get<1>(GetParam());
  Hosts hosts(n);
  std::vector<std::vector<int64_t>> data(n, std::vector<int64_t>(count));
  for (int h = 0; h < n; ++h) {
    for (size_t i = 0; i < count; ++i) data[h][i] = static_cast<int64_t>((i * 7 + h * 13) % 31);
  }
  ExpectAllOk(hosts.Run("k", 1, [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(data[h].data());
    return AllReduceAcrossHosts(s, DType::kI64, ReduceOp::kMax, p, p, count);
  }));
  for (int h = 0; h < n; ++h) {
    for (size_t i = 0; i < count; i += std::max<size_t>(1, count / 50)) {
      int64_t want = 0;
      for (int g = 0; g < n; ++g) want = std::max<int64_t>(want, (i * 7 + g * 13) % 31);
      ASSERT_EQ(data[h][i], want) << "host " << h << " element " << i;
    }
  }
}

TEST_P(CrossHostTest, ReduceScatterLeavesEachHostItsSegment) {
  const int n = std::get<0>(GetParam());
  const size_t count = std::get<1>(GetParam());
  Hosts hosts(n);
  const size_t total = count * n;  // each host owns `count` elements, interleaved in two halves
  std::vector<std::vector<int32_t>> data(n, std::vector<int32_t>(total));
  for (int h = 0; h < n; ++h) std::iota(data[h].begin(), data[h].end(), h);
  ExpectAllOk(hosts.Run("k", 1, [&](int h, MeshSteps& s) {
    char* base = reinterpret_cast<char*>(data[h].data());
    Segments segments(n);
    const size_t half = count / 2;
    for (int g = 0; g < n; ++g) {
      // Host g owns [g*half, (g+1)*half) and the matching range in the second half of the buffer.
      segments[g].push_back({base + g * half * 4, half * 4});
      segments[g].push_back({base + (n * half + g * (count - half)) * 4, (count - half) * 4});
    }
    return ReduceScatterAcrossHosts(s, DType::kI32, ReduceOp::kSum, base, total, segments);
  }));
  const size_t half = count / 2;
  for (int h = 0; h < n; ++h) {
    const int base_sum = n * (n - 1) / 2;
    for (size_t i = h * half; i < (h + 1) * half; ++i) ASSERT_EQ(data[h][i], n * static_cast<int>(i) + base_sum);
    for (size_t i = n * half + h * (count - half); i < n * half + (h + 1) * (count - half); ++i) {
      ASSERT_EQ(data[h][i], n * static_cast<int>(i) + base_sum);
    }
  }
}

TEST_P(CrossHostTest, AllGatherAndBroadcastCopyEveryByte) {
  const int n = std::get<0>(GetParam());
  const size_t count = std::get<1>(GetParam());
  Hosts hosts(n);
  // The runtime's choice, then each small algorithm (large messages take a ring whichever).
  const std::optional<SmallAlgorithm> algorithms[] = {std::nullopt, SmallAlgorithm::kDirect,
                                                      SmallAlgorithm::kLogRounds};
  for (uint64_t a = 0; a < std::size(algorithms); ++a) {
    SCOPED_TRACE(a == 0 ? "chosen" : a == 1 ? "direct" : "log rounds");
    std::vector<std::string> gathered(n, std::string(count * n, '\0'));
    std::vector<std::string> broadcast(n, std::string(count, '\0'));
    for (int h = 0; h < n; ++h) {
      for (size_t i = 0; i < count; ++i) gathered[h][h * count + i] = static_cast<char>('a' + (h + i + a) % 26);
    }
    const int root = (n - 1 + static_cast<int>(a)) % n;
    for (size_t i = 0; i < count; ++i) broadcast[root][i] = static_cast<char>('A' + (i + a) % 26);
    ExpectAllOk(hosts.Run("k", a + 1, [&](int h, MeshSteps& s) {
      Segments segments(n);
      for (int g = 0; g < n; ++g) segments[g].push_back({gathered[h].data() + g * count, count});
      PW_RETURN_IF_ERROR(AllGatherAcrossHosts(s, segments, algorithms[a]));
      return BroadcastAcrossHosts(s, root, broadcast[h].data(), count, algorithms[a]);
    }));
    for (int h = 0; h < n; ++h) {
      EXPECT_EQ(gathered[h], gathered[root]) << "host " << h;
      EXPECT_EQ(broadcast[h], broadcast[root]) << "host " << h;
    }
    for (int g = 0; g < n; ++g) EXPECT_EQ(gathered[0][g * count], static_cast<char>('a' + (g + a) % 26));
  }
}

TEST_P(CrossHostTest, MaxAgreesBitForBitWithNansAndSignedZeros) {
  const int n = std::get<0>(GetParam());
  const size_t count = std::get<1>(GetParam());
  Hosts hosts(n);
  std::vector<std::vector<float>> data(n, std::vector<float>(count));
  for (int h = 0; h < n; ++h) {
    for (size_t i = 0; i < count; ++i) {
      // Max is not commutative on these: every host must still end with the same bits.
      const float pick[] = {0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(), 1.0f};
      data[h][i] = pick[(i + h) % 4];
    }
  }
  ExpectAllOk(hosts.Run("k", 1, [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(data[h].data());
    return AllReduceAcrossHosts(s, DType::kF32, ReduceOp::kMax, p, p, count);
  }));
  for (int h = 1; h < n; ++h) {
    EXPECT_EQ(std::memcmp(data[h].data(), data[0].data(), count * sizeof(float)), 0) << "host " << h;
  }
}

INSTANTIATE_TEST_SUITE_P(SizesAndHosts, CrossHostTest,
                         ::testing::Combine(::testing::Values(2, 3, 4, 5, 8),
                                            ::testing::Values(size_t{1} << 1, size_t{1} << 10, size_t{1} << 17,
                                                              (size_t{1} << 17) + 3)),  // splits unevenly
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "hosts_", std::get<1>(info.param), "elements");
                         });

// all_to_all with blocks of different sizes between every pair of hosts (host h stands for
// h % 3 + 1 members, as a gang spread unevenly would): every byte reaches its host, whichever
// way it travels, relayed or not.
const char* AlgorithmName(SmallAlgorithm a) { return a == SmallAlgorithm::kDirect ? "Direct" : "Bruck"; }

class AllToAllTest
    : public ::testing::TestWithParam<std::tuple<int /*hosts*/, size_t /*bytes per pair of members*/, SmallAlgorithm>> {
};

TEST_P(AllToAllTest, EveryBlockReachesItsHostIntact) {
  // Not a structured binding: clang 14 (the sanitizer builds) cannot capture one in a lambda.
  const int n = std::get<0>(GetParam());
  const size_t chunk = std::get<1>(GetParam());
  const SmallAlgorithm algorithm = std::get<2>(GetParam());
  Hosts hosts(n);
  auto block_bytes = [&](int a, int b) { return static_cast<size_t>(a % 3 + 1) * (b % 3 + 1) * chunk; };
  auto byte = [](int a, int b, size_t i) { return static_cast<char>((a * 31 + b * 7 + i) % 251); };
  std::vector<std::vector<std::string>> sent(n, std::vector<std::string>(n)), got(n, std::vector<std::string>(n));
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      for (size_t i = 0; i < block_bytes(a, b); ++i) sent[a][b].push_back(byte(a, b, i));
      got[b][a].assign(block_bytes(a, b), '\0');
    }
  }
  ExpectAllOk(hosts.Run("k", 1, [&](int h, MeshSteps& s) {
    std::vector<std::vector<Piece>> send(n), recv(n);
    for (int g = 0; g < n; ++g) {
      if (g == h) continue;
      // Two pieces each way: blocks are gathered from and scattered into several ranges.
      std::string& out = sent[h][g];
      std::string& in = got[h][g];
      send[g] = {{out.data(), out.size() / 2}, {out.data() + out.size() / 2, out.size() - out.size() / 2}};
      recv[g] = {{in.data(), in.size() / 3}, {in.data() + in.size() / 3, in.size() - in.size() / 3}};
    }
    return AllToAllAcrossHosts(s, send, recv, block_bytes, algorithm);
  }));
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) EXPECT_EQ(got[b][a], sent[a][b]) << "host " << a << "'s block for host " << b;
  }
}

INSTANTIATE_TEST_SUITE_P(HostsSizesAndAlgorithms, AllToAllTest,
                         ::testing::Combine(::testing::Values(2, 3, 5, 8, 9),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{300}),
                                            ::testing::Values(SmallAlgorithm::kDirect, SmallAlgorithm::kLogRounds)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "hosts_", std::get<1>(info.param), "bytes_",
                                               AlgorithmName(std::get<2>(info.param)));
                         });

}  // namespace
}  // namespace pathways::collective
