#include "multiprocess_fixture.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace pathways {

HostArray Pattern(Shape shape, float scale) {
  HostArray a = *HostArray::Create(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    a.mutable_data<float>()[i] = scale * static_cast<float>((i * 31) % 17 - 8);
  }
  return a;
}

void ExpectAJobOnTwoDevicesRuns(Client& client) {
  VirtualSlice slice = *client.CreateSlice({.mesh_shape = {2}});
  const TensorSpec row{DType::kF32, {2}};
  auto inc = *client.Compile(FunctionSpec::Builtin("add_one", {row}, {row}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client.Put(Pattern({2}, 1.0f), slice, {"x"});
  auto call = client.Call(inc, slice, {x});
  ASSERT_TRUE(call.ok()) << call.status();
  auto got = client.Fetch((*call)[0]).Await();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->data<float>()[1], Pattern({2}, 1.0f).data<float>()[1] + 1);
}

std::pair<int, std::string> RunToEnd(const std::string& args) {
  return RunShell(absl::StrCat("exec ", PATHWAYS_BINARY, " ", args), absl::Seconds(60));
}

void ExpectFailedSaying(const std::pair<int, std::string>& r, const std::string& says) {
  EXPECT_TRUE(WIFEXITED(r.first) && WEXITSTATUS(r.first) != 0) << "status " << r.first << ": " << r.second;
  EXPECT_NE(r.second.find(says), std::string::npos) << r.second;
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) close(fd);
    return 0;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace pathways
