// A controller that restarts, in one process: what a client's schedule request does meanwhile.
#include <string>

#include "absl/strings/str_cat.h"
#include "controller/controller.h"
#include "core/logging.h"
#include "gtest/gtest.h"
#include "multiprocess_fixture.h"
#include "transport/auth.h"
#include "transport/controller_client.h"

namespace pathways {
namespace {

// A request made while no controller listens at its address was never sent: it waits, reaches
// the controller started there meanwhile, and that one, being new, holds it for the host it
// names (none comes here) and answers with the refusal once its hold ends. Before, it failed at
// once ("failed to connect to all addresses").
TEST(ControllerRestartTest, ARequestMadeWhileNoControllerListensReachesTheNextOne) {
  // The port found free may be taken by another test's process before the controller binds it
  // (access_test saw that race once): then the whole exchange is tried again on another port.
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int port = FreePort();
    ASSERT_GT(port, 0);
    const std::string address = absl::StrCat("127.0.0.1:", port);
    ControllerClient client(address);
    const ClientIdentity me = NewClientIdentity();
    rpc::ScheduleRequest request;
    request.set_client_id(me.id);
    request.set_credential(me.credential);
    request.set_weight(1);
    request.add_runs()->add_hosts()->set_host("127.0.0.1:1");
    Future<Unit> answer = client.Schedule(request);
    const bool answered_early = answer.WaitFor(absl::Milliseconds(300));  // by a process that took the port?

    ControllerOptions options;
    options.listen_address = address;
    options.heartbeat_timeout = absl::Milliseconds(200);  // its hold: 2.2 s
    Controller controller(options);
    const absl::Status started = controller.Start();
    if (!started.ok()) {
      PW_LOG(Warning) << "attempt " << attempt << " could not start the controller: " << started;
      continue;
    }
    EXPECT_FALSE(answered_early) << "the request should have waited, not failed";
    auto answered = answer.AwaitFor(absl::Seconds(30));
    ASSERT_FALSE(answered.ok());
    EXPECT_EQ(answered.status().code(), absl::StatusCode::kNotFound) << answered.status();
    EXPECT_NE(answered.status().message().find("no worker at 127.0.0.1:1 is registered"), std::string::npos)
        << answered.status();
    EXPECT_NE(answered.status().message().find("after holding the request"), std::string::npos)
        << answered.status();
    return;
  }
  FAIL() << "no attempt could start a controller on a port found free";
}

}  // namespace
}  // namespace pathways
