#include "controller/schedule_admission.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

rpc::RegisterWorkerRequest Worker(const std::string& address, int island) {
  rpc::RegisterWorkerRequest r;
  r.set_address(address);
  r.set_island(island);
  r.add_devices()->set_memory_capacity(1 << 20);
  return r;
}

// One run of `client` over `hosts`.
rpc::ScheduleRequest Request(const std::string& client, const std::vector<std::string>& hosts, double weight = 1) {
  rpc::ScheduleRequest r;
  r.set_client_id(client);
  r.set_weight(weight);
  rpc::GangRun* run = r.add_runs();
  for (const std::string& h : hosts) run->add_hosts()->set_host(h);
  return r;
}

// Admission in front of a registry, with schedulers that record what reaches them (by island;
// -1 for runs over several islands) and take it at once.
class ScheduleAdmissionTest : public ::testing::Test {
 protected:
  ScheduleAdmission Make(absl::Time hold_until) {
    return ScheduleAdmission(
        registry_, /*max_weight=*/100, hold_until,
        {[this](int island, const std::string&, double, std::vector<rpc::GangRun> runs) {
           reached_[island] += static_cast<int>(runs.size());
           return Future<Unit>::Ready(Unit{});
         },
         [this](const std::string&, double, std::vector<std::pair<int, rpc::GangRun>>) {
           ++reached_[-1];
           return Future<Unit>::Ready(Unit{});
         },
         [this](const std::string&, const std::string& tenant) {
           return refused_.contains(tenant) ? absl::FailedPreconditionError("this cluster refuses tenant " + tenant)
                                            : absl::OkStatus();
         }});
  }
  void Register(const std::string& host, int island, const std::string& client) {
    ASSERT_TRUE(registry_.RegisterWorker(Worker(host, island), absl::Now()).ok());
    registry_.NoteClientOnHost(client, host);
  }
  ClusterRegistry registry_{absl::Hours(1)};
  std::map<int, int> reached_;
  std::set<std::string> refused_;  // tenants
};

TEST_F(ScheduleAdmissionTest, RunsGoToTheirIslandsAndRunsOverSeveralToAllTogether) {
  Register("a:1", 0, "c");
  Register("b:1", 1, "c");
  ScheduleAdmission admission = Make(absl::InfinitePast());
  ASSERT_TRUE(admission.SubmitOrHold(Request("c", {"a:1"}), "").Await().ok());
  ASSERT_TRUE(admission.SubmitOrHold(Request("c", {"a:1", "b:1"}), "").Await().ok());
  EXPECT_EQ(reached_, (std::map<int, int>{{-1, 1}, {0, 1}}));
}

TEST_F(ScheduleAdmissionTest, BadRequestsAreRefusedAndNothingOfThemReachesAScheduler) {
  Register("a:1", 0, "c");
  ScheduleAdmission admission = Make(absl::InfinitePast());
  EXPECT_EQ(admission.SubmitOrHold(Request("", {"a:1"}), "").Await().status().code(), absl::StatusCode::kInvalidArgument);
  auto heavy = admission.SubmitOrHold(Request("c", {"a:1"}, 1e9), "").Await();
  EXPECT_EQ(heavy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(heavy.status().message().find("--max-client-weight"), std::string::npos) << heavy.status();
  EXPECT_EQ(admission.SubmitOrHold(Request("c", {}), "").Await().status().code(), absl::StatusCode::kInvalidArgument);
  // A host it has no slice on, after a good run in the same request: neither goes.
  Register("a:2", 0, "someone else");
  rpc::ScheduleRequest mixed = Request("c", {"a:1"});
  mixed.add_runs()->add_hosts()->set_host("a:2");
  EXPECT_EQ(admission.SubmitOrHold(mixed, "").Await().status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(reached_.empty());
  EXPECT_EQ(admission.num_held(), 0u);  // not new: nothing is held
}

// A controller that restarted: a request naming a host that has not registered again is held,
// and goes once the host registers and names the client; one still refused when the hold ends
// fails with the refusal; closing fails what is held.
TEST_F(ScheduleAdmissionTest, WhileNewARequestForAHostNotBackYetWaitsForIt) {
  const absl::Time start = absl::Now();
  ScheduleAdmission admission = Make(start + absl::Hours(1));
  Future<Unit> waits = admission.SubmitOrHold(Request("c", {"a:1"}), "");
  Future<Unit> never = admission.SubmitOrHold(Request("c", {"z:9"}), "");
  EXPECT_EQ(admission.num_held(), 2u);
  admission.RetryHeld(start);
  EXPECT_FALSE(waits.IsReady());
  Register("a:1", 0, "c");
  admission.RetryHeld(start);
  ASSERT_TRUE(waits.IsReady());
  EXPECT_TRUE(waits.Await().ok()) << waits.Await().status();
  EXPECT_EQ(reached_[0], 1);
  EXPECT_FALSE(never.IsReady());
  admission.RetryHeld(start + absl::Hours(2));
  ASSERT_TRUE(never.IsReady());
  EXPECT_EQ(never.Await().status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(never.Await().status().message().find("no worker at z:9"), std::string::npos) << never.Await().status();
  EXPECT_NE(never.Await().status().message().find("after holding"), std::string::npos) << never.Await().status();

  Future<Unit> closed = admission.SubmitOrHold(Request("c", {"z:9"}), "");
  admission.Close();
  EXPECT_EQ(closed.Await().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(admission.SubmitOrHold(Request("c", {"a:1"}), "").Await().status().code(), absl::StatusCode::kUnavailable);
}

// A controller that restarted learns of a refused tenant as hosts register, while it holds
// requests: a held request of that tenant is checked again, and refused, before it goes.
TEST_F(ScheduleAdmissionTest, AHeldRequestOfATenantRefusedMeanwhileIsRefused) {
  ScheduleAdmission admission = Make(absl::InfiniteFuture());
  Future<Unit> spinner = admission.SubmitOrHold(Request("s", {"a:1"}), "spinner");
  Future<Unit> other = admission.SubmitOrHold(Request("c", {"a:1"}), "other");
  refused_.insert("spinner");
  Register("a:1", 0, "s");
  registry_.NoteClientOnHost("c", "a:1");
  admission.RetryHeld(absl::Now());
  ASSERT_TRUE(spinner.IsReady() && other.IsReady());
  EXPECT_EQ(spinner.Await().status().code(), absl::StatusCode::kFailedPrecondition) << spinner.Await().status();
  EXPECT_TRUE(other.Await().ok()) << other.Await().status();
  EXPECT_EQ(reached_[0], 1);
}

// Holding is bounded: past kMaxHeld requests, or kMaxHeldBytes, a refused one is answered at once.
TEST_F(ScheduleAdmissionTest, HeldRequestsAreBoundedInNumberAndBytes) {
  ScheduleAdmission admission = Make(absl::InfiniteFuture());
  std::vector<Future<Unit>> held;
  for (size_t i = 0; i < ScheduleAdmission::kMaxHeld; ++i) held.push_back(admission.SubmitOrHold(Request("c", {"z:9"}), ""));
  EXPECT_EQ(admission.num_held(), ScheduleAdmission::kMaxHeld);
  EXPECT_EQ(admission.SubmitOrHold(Request("c", {"z:9"}), "").Await().status().code(), absl::StatusCode::kNotFound);
  admission.Close();
  for (const auto& f : held) EXPECT_EQ(f.Await().status().code(), absl::StatusCode::kUnavailable);

  // Requests of a little over 1 MiB each (a run's payload is opaque here): 63 are held, the next
  // is answered.
  ScheduleAdmission by_bytes = Make(absl::InfiniteFuture());
  rpc::ScheduleRequest large = Request("c", {"z:9"});
  large.mutable_runs(0)->mutable_run()->mutable_arg_array_ids()->Resize(1 << 20, 1);  // a byte each
  ASSERT_GE(large.ByteSizeLong(), size_t{1} << 20);
  size_t n = 0;
  while (n <= ScheduleAdmission::kMaxHeld && !by_bytes.SubmitOrHold(large, "").IsReady()) ++n;  // bounded: a broken bound fails, not hangs
  EXPECT_EQ(n, ScheduleAdmission::kMaxHeldBytes / large.ByteSizeLong());
  by_bytes.Close();
}

}  // namespace
}  // namespace pathways
