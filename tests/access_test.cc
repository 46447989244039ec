// Who may use a cluster of real processes, and what: tokens, tenants kept from each other's data,
// TLS, and addresses that have one owner.
#include <signal.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "client/client.h"
#include "dataflow/stream_peer.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "multiprocess_fixture.h"
#include "testing/loopback.h"
#include "testing/subprocess.h"
#include "transport/auth.h"
#include "transport/controller_client.h"
#include "transport/schedule_stream.h"
#include "transport/worker_client.h"

namespace pathways {
namespace {

// Starts a controller and a worker of 2 devices that require `token`; the controller's address.
void StartGuardedCluster(Subprocess& controller, Subprocess& worker, const std::string& token, std::string* address) {
  ASSERT_TRUE(controller.Start({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0", "--token", token}).ok());
  auto line = controller.WaitForLine("listening on", kStartTimeout);
  ASSERT_TRUE(line.ok()) << line.status();
  *address = line->substr(line->rfind(' ') + 1);
  ASSERT_TRUE(worker.Start({PATHWAYS_BINARY, "worker", "--controller", *address, "--devices", "2", "--token", token})
                  .ok());
}

// Access control: a controller and worker that require a token refuse every call without it,
// with Unauthenticated; status says so; with the token everything works.
TEST_F(MultiProcessTest, AClustersTokenIsRequiredOfEveryCall) {
  Subprocess controller, worker;
  std::string address;
  ASSERT_NO_FATAL_FAILURE(StartGuardedCluster(controller, worker, "s3cret", &address));
  ASSERT_TRUE(worker.WaitForLine("serving", kStartTimeout).ok());  // it registered: it has the token

  auto status = [&](const std::string& token_flag) {
    return *RunCommand({"/bin/sh", "-c",
                        absl::StrCat("env -u PATHWAYS_TOKEN ", PATHWAYS_BINARY, " status --controller ", address, " ",
                                     token_flag, " 2>&1; echo exit=$?")},
                       absl::Seconds(30));
  };
  std::string none = status("");
  EXPECT_NE(none.find("requires a token"), std::string::npos) << none;
  EXPECT_NE(none.find("exit=1"), std::string::npos) << none;
  std::string wrong = status("--token guess");
  EXPECT_NE(wrong.find("not this cluster's"), std::string::npos) << wrong;
  std::string right = status("--token s3cret");
  EXPECT_NE(right.find("1 islands, 1 hosts"), std::string::npos) << right;

  // The client library sends the process's token (PATHWAYS_TOKEN, or SetCallToken).
  SetCallToken("");
  auto refused = Client::Connect(address);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  SetCallToken("s3cret");
  auto client = Client::Connect(address);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_NO_FATAL_FAILURE(ExpectAJobOnTwoDevicesRuns(**client));
  client->reset();
  SetCallToken("");  // the fixture's cluster needs none
  EXPECT_EQ(worker.Stop(SIGTERM) & 0x7f, 0);
  EXPECT_EQ(controller.Stop(SIGTERM) & 0x7f, 0);
}

// Clients of one process show each its own cluster's token (ClientOptions::token): one to a
// cluster that requires a token, one to the fixture's that requires none, both working at once,
// while the process's own token is a wrong one; a client given the wrong token is refused, and a
// token gRPC could not carry is refused before anything is sent.
TEST_F(MultiProcessTest, ClientsOfOneProcessShowTheirOwnClustersTokens) {
  Subprocess controller, worker;
  std::string address;
  ASSERT_NO_FATAL_FAILURE(StartGuardedCluster(controller, worker, "s3cret", &address));
  ASSERT_TRUE(worker.WaitForLine("serving", kStartTimeout).ok());

  SetCallToken("not-the-token");  // what a client without a token of its own shows
  absl::Cleanup restore = [] { SetCallToken(""); };  // the fixture's cluster needs none
  auto wrong = Client::Connect(address, {.token = "guess"});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated) << wrong.status();
  auto guarded = Client::Connect(address, {.token = "s3cret"});
  ASSERT_TRUE(guarded.ok()) << guarded.status();
  auto open = Client::Connect(address_);
  ASSERT_TRUE(open.ok()) << open.status();
  // Interleaved: each client's calls carry its own token (`open` shows the process's wrong one,
  // which the fixture's cluster, requiring none, ignores).
  ClientStats after_first;
  for (int round = 0; round < 2; ++round) {
    ASSERT_NO_FATAL_FAILURE(ExpectAJobOnTwoDevicesRuns(**guarded));
    ASSERT_NO_FATAL_FAILURE(ExpectAJobOnTwoDevicesRuns(**open));
    if (round == 0) after_first = (*guarded)->stats();
  }
  // Its streams carry its token too: a schedule stream the controller refused would make the
  // requests go as unary calls, without failing them. Once its streams are made (in the first
  // job), the second job's schedule requests, op batches and fetches all go over them.
  const ClientStats after_second = (*guarded)->stats();
  EXPECT_GT(after_second.schedule_requests_streamed, after_first.schedule_requests_streamed);
  EXPECT_EQ(after_second.schedule_requests_unary, after_first.schedule_requests_unary);
  EXPECT_GT(after_second.worker_requests_streamed, after_first.worker_requests_streamed);
  EXPECT_EQ(after_second.worker_requests_grpc, after_first.worker_requests_grpc);
  // The process's token was never changed: a client without a token of its own is refused there.
  auto unguarded = Client::Connect(address);
  EXPECT_EQ(unguarded.status().code(), absl::StatusCode::kUnauthenticated) << unguarded.status();
  for (const std::string& bad : {std::string("s3cret\n"), std::string("s\xc3\xa9" "cret"), std::string(5000, 'x')}) {
    auto refused = Client::Connect(address, {.token = bad});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  }
  guarded->reset();
  open->reset();
  EXPECT_EQ(worker.Stop(SIGTERM) & 0x7f, 0);
  EXPECT_EQ(controller.Stop(SIGTERM) & 0x7f, 0);
}

// One tenant tries every path into another's data and lease. It holds the cluster's token and
// knows the victim's id (as from a log), its array and slice ids (they count from 1), and has a
// valid identity of its own. Each call is refused; afterwards the victim's data and lease are whole.
TEST_F(MultiProcessTest, ATenantCannotReachAnotherTenantsDataOrLease) {
  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {8}});
  const TensorSpec row{DType::kF32, {8}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {row}, {row}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client_->Put(Pattern({8}, 1.0f), slice, {"x"});
  ShardedArray y = (*client_->Call(inc, slice, {x}))[0];
  ASSERT_TRUE(client_->Fetch(y).Await().ok());

  const std::string victim = client_->id();
  const ClientIdentity thief = NewClientIdentity();
  auto refused = [](const absl::Status& s, const char* path) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << path << ": " << s;
  };
  // Every way a call can name the victim: no credential, the thief's own, a made-up one.
  const std::vector<std::string> forged = {"", thief.credential, std::string(64, '0')};
  ControllerClient controller(address_);
  for (const std::string& credential : forged) {
    refused(controller.ClientHeartbeat({victim, credential}, /*goodbye=*/true).status(), "goodbye");
    rpc::SliceStatesRequest states;
    states.set_client_id(victim);
    states.set_credential(credential);
    refused(controller.SliceStates(states).status(), "SliceStates");
    rpc::RemapSliceRequest remap;
    remap.set_client_id(victim);
    remap.set_credential(credential);
    remap.set_slice_id(slice.id().value());
    refused(controller.RemapSlice(remap).status(), "RemapSlice");
    rpc::AllocateSliceRequest allocate;
    allocate.set_client_id(victim);
    allocate.set_credential(credential);
    allocate.add_mesh_shape(8);
    refused(controller.AllocateSlice(allocate).status(), "AllocateSlice");
    rpc::ScheduleRequest schedule;
    schedule.set_client_id(victim);
    schedule.set_credential(credential);
    schedule.add_runs()->mutable_run()->set_program_id(1);
    refused(controller.Schedule(schedule).AwaitFor(absl::Seconds(30)).status(), "Schedule");
    for (const std::string& host : worker_addresses_) {
      std::shared_ptr<WorkerClient> worker = WorkerClientCache::Global().Get(host);
      for (ArrayId id : {x.id(), y.id()}) {
        rpc::FetchRequest fetch;
        fetch.set_client_id(victim);
        fetch.set_credential(credential);
        fetch.set_array_id(id.value());
        for (int s = 0; s < 8; ++s) fetch.add_shards(s);
        refused(worker->Fetch(fetch, 1 << 20).AwaitFor(absl::Seconds(30)).status(), "Fetch");
        rpc::EnqueueRequest free;
        free.set_client_id(victim);
        free.set_credential(credential);
        free.add_ops()->mutable_free()->set_array_id(id.value());
        refused(worker->Enqueue(std::make_shared<rpc::EnqueueRequest>(free)).AwaitFor(absl::Seconds(30)).status(), "Enqueue");
      }
      rpc::GetTraceRequest trace;
      trace.set_client_id(victim);
      trace.set_credential(credential);
      refused(worker->GetTrace(trace).AwaitFor(absl::Seconds(30)).status(), "GetTrace");
    }
  }
  // Under its own identity the thief reaches only its own (empty) namespace.
  for (const std::string& host : worker_addresses_) {
    rpc::FetchRequest fetch;
    fetch.set_client_id(thief.id);
    fetch.set_credential(thief.credential);
    fetch.set_array_id(x.id().value());
    fetch.add_shards(0);
    auto got = WorkerClientCache::Global().Get(host)->Fetch(fetch, 1 << 20).AwaitFor(absl::Seconds(30));
    EXPECT_FALSE(got.ok());
    EXPECT_NE(got.status().code(), absl::StatusCode::kUnauthenticated) << got.status();
  }
  // Nor can it run work on the devices leased to the victim: a run naming a host where it has no
  // slice is refused (before this check, the controller scheduled it).
  for (const std::string& host : worker_addresses_) {
    rpc::ScheduleRequest schedule;
    schedule.set_client_id(thief.id);
    schedule.set_credential(thief.credential);
    rpc::GangRun* run = schedule.add_runs();
    run->mutable_run()->set_program_id(1);
    run->add_hosts()->set_host(host);
    auto scheduled = controller.Schedule(schedule).AwaitFor(absl::Seconds(30));
    EXPECT_EQ(scheduled.status().code(), absl::StatusCode::kPermissionDenied) << scheduled.status();
    EXPECT_NE(scheduled.status().message().find("has no slice"), std::string::npos) << scheduled.status();
  }
  // `status` shows the victim by a label, not by its id.
  auto status = RunCommand({PATHWAYS_BINARY, "status", "--controller", address_}, absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->find(victim), std::string::npos) << *status;

  // The victim's lease held through a whole lease period (1 s here) after the forged goodbyes,
  // and its data is intact: this waits out a span in which nothing may happen.
  absl::SleepFor(absl::Milliseconds(1500));
  auto again = client_->Fetch(y).AwaitFor(absl::Seconds(30));
  ASSERT_TRUE(again.ok()) << again.status();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(again->data<float>()[i], Pattern({8}, 1.0f).data<float>()[i] + 1);
  auto z = client_->Fetch((*client_->Call(inc, slice, {y}))[0]).AwaitFor(absl::Seconds(30));
  ASSERT_TRUE(z.ok()) << z.status();
}

// What a tenant's function may call is its workers' to say: the fixture's workers allow the vetted
// ops only, so a function calling another public op is refused at Compile, naming it (a function
// compiles on every live worker); a cluster whose worker runs `--function-ops public` runs it.
TEST_F(MultiProcessTest, WhatAFunctionMayCallIsItsWorkersToSay) {
  const TensorSpec row{DType::kF32, {3}};
  const FunctionSpec windowed = FunctionSpec::Script(
      "windowed", "def windowed(x):\n    return x + torch.kaiser_window(3, False)\n", {row}, {row});
  auto refused = client_->Compile(windowed);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("aten::kaiser_window"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("--function-ops public"), std::string::npos) << refused.status();

  Subprocess controller, open;
  ASSERT_TRUE(controller.Start({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"}).ok());
  auto line = controller.WaitForLine("listening on", kStartTimeout);
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string address = line->substr(line->rfind(' ') + 1);
  ASSERT_TRUE(
      open.Start({PATHWAYS_BINARY, "worker", "--controller", address, "--devices", "1", "--function-ops", "public"})
          .ok());
  ASSERT_TRUE(open.WaitForLine("serving", kStartTimeout).ok());
  auto client = Client::Connect(address);
  ASSERT_TRUE(client.ok()) << client.status();
  auto fn = (*client)->Compile(windowed);
  ASSERT_TRUE(fn.ok()) << fn.status();
  VirtualSlice slice = *(*client)->CreateSlice({.mesh_shape = {1}});
  ShardedArray x = *(*client)->Put(Pattern({3}, 0.0f), slice, {});
  auto y = (*client)->Fetch((*(*client)->Call(*fn, slice, {x}))[0]).AwaitFor(absl::Seconds(30));
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_NEAR(y->data<float>()[1], 1.0f, 1e-6);
  EXPECT_NEAR(y->data<float>()[0], 0.0f, 1e-3);
  client->reset();
  EXPECT_EQ(open.Stop(SIGTERM) & 0x7f, 0);
  EXPECT_EQ(controller.Stop(SIGTERM) & 0x7f, 0);
}

// TLS: a controller and worker serving with a certificate; status and a client job that trust its
// CA work, one that does not cannot connect.
TEST_F(MultiProcessTest, ClustersServeTlsWhenGivenACertificate) {
  const std::string dir = ::testing::TempDir() + "/pathways_tls";
  auto made = RunCommand({"/bin/sh", "-c",
                          absl::StrCat("mkdir -p ", dir, " && openssl req -x509 -newkey rsa:2048 -nodes -days 1",
                                       " -keyout ", dir, "/key.pem -out ", dir, "/cert.pem -subj /CN=127.0.0.1",
                                       " -addext subjectAltName=IP:127.0.0.1 2>&1; echo exit=$?")},
                         absl::Seconds(60));
  ASSERT_TRUE(made.ok() && made->find("exit=0") != std::string::npos) << (made.ok() ? *made : made.status().ToString());
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem";
  Subprocess controller, worker;
  ASSERT_TRUE(controller.Start({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0", "--tls-cert", cert,
                                "--tls-key", key, "--tls-ca", cert})
                  .ok());
  auto line = controller.WaitForLine("listening on", kStartTimeout);
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string address = line->substr(line->rfind(' ') + 1);
  ASSERT_TRUE(worker.Start({PATHWAYS_BINARY, "worker", "--controller", address, "--devices", "2", "--tls-cert", cert,
                            "--tls-key", key, "--tls-ca", cert})
                  .ok());
  ASSERT_TRUE(worker.WaitForLine("serving", kStartTimeout).ok());  // it registered over TLS

  auto run = [&](const std::string& args) {
    return *RunCommand({"/bin/sh", "-c",
                        absl::StrCat("env -u PATHWAYS_TLS_CA ", PATHWAYS_BINARY, " ", args, " 2>&1; echo exit=$?")},
                       absl::Seconds(60));
  };
  std::string plain = run(absl::StrCat("status --controller ", address));
  EXPECT_NE(plain.find("exit=1"), std::string::npos) << plain;
  std::string trusted = run(absl::StrCat("status --controller ", address, " --tls-ca ", cert));
  EXPECT_NE(trusted.find("1 islands, 1 hosts"), std::string::npos) << trusted;
  std::string job = run(absl::StrCat("tenant --controller ", address, " --tls-ca ", cert, " --devices 2 --runs 20"));
  EXPECT_NE(job.find("CHECK PASSED"), std::string::npos) << job;
  EXPECT_EQ(worker.Stop(SIGTERM) & 0x7f, 0);
  EXPECT_EQ(controller.Stop(SIGTERM) & 0x7f, 0);
}

TEST_F(MultiProcessTest, AnAddressHasOneOwnerAndBadAddressesFailAtStart) {
  // A second worker on a running worker's port, a second controller on the controller's.
  ExpectFailedSaying(RunToEnd(absl::StrCat("worker --controller ", address_, " --listen ", worker_addresses_[0])),
              "cannot listen on " + worker_addresses_[0]);
  ExpectFailedSaying(RunToEnd(absl::StrCat("controller --listen ", address_)), "cannot listen on " + address_);
  // Ports out of range, and a port file that cannot be written.
  ExpectFailedSaying(RunToEnd(absl::StrCat("worker --controller ", address_, " --listen 127.0.0.1:70000")), "70000");
  ExpectFailedSaying(RunToEnd("worker --controller 127.0.0.1:65536"), "65536");
  ExpectFailedSaying(RunToEnd("controller --listen 127.0.0.1:0 --port-file /nonexistent-dir/port"), "--port-file");
  // Trace files too, at start rather than after the job's work.
  ExpectFailedSaying(RunToEnd(absl::StrCat("tenant --controller ", address_, " --trace /nonexistent-dir/t.json")),
                     "--trace: cannot write /nonexistent-dir/t.json");
  ExpectFailedSaying(RunToEnd("demo --trace /nonexistent-dir/t.json"), "--trace: cannot write");
  ExpectFailedSaying(RunToEnd("train --steps 1 --trace /nonexistent-dir/t.json"), "--trace: cannot write");
  // A wildcard address, which they would give others to reach them by.
  ExpectFailedSaying(RunToEnd("controller --listen 0.0.0.0:0"), "a wildcard reaches no one");
  ExpectFailedSaying(RunToEnd(absl::StrCat("worker --controller ", address_, " --listen [::]:0")), "a wildcard reaches no one");
  // Tokens that gRPC could not carry (it would abort the process at the first call): refused at
  // start, naming where they came from, never echoed.
  ExpectFailedSaying(RunToEnd("controller --listen 127.0.0.1:0 --token \"$(printf 'a\\nb')\""),
                     "the token from --token (3 bytes) is not printable ASCII");
  ExpectFailedSaying(RunToEnd(absl::StrCat("worker --controller ", address_, " --cluster-token \"$(printf '\\377')\"")),
                     "the token from --cluster-token");
  ExpectFailedSaying(RunToEnd(absl::StrCat("status --controller ", address_, " --token \"$(printf 'a\\tb')\"")),
                     "the token from --token");
  ExpectFailedSaying(RunToEnd(absl::StrCat("tenant --controller ", address_, " --token ", std::string(5000, 'x'))),
                     "(5000 bytes) is not printable ASCII of at most 4096 bytes");
  // The cluster is untouched: both workers still serve the client.
  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {8}});
  EXPECT_EQ(slice.host_addresses().size(), 2u);
  const TensorSpec row{DType::kF32, {8}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {row}, {row}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client_->Put(Pattern({8}, 1.0f), slice, {"x"});
  auto out = client_->Fetch((*client_->Call(inc, slice, {x}))[0]).AwaitFor(absl::Seconds(30));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->data<float>()[0], Pattern({8}, 1.0f).data<float>()[0] + 1);
}

TEST_F(MultiProcessTest, AWorkersDataAndLinkPortsCanBeFixedAndAreItsAlone) {
  // A port found free may be taken by another test's process before the worker binds it (seen in
  // a clean-clone run: "Address already in use", the worker gone at once): then two other ports
  // are tried, a few times.
  int data_port = 0, link_port = 0;
  std::unique_ptr<Subprocess> worker;
  absl::Status served;
  for (int attempt = 0; attempt < 5; ++attempt) {
    data_port = FreePort(), link_port = FreePort();
    ASSERT_GT(data_port, 0);
    ASSERT_GT(link_port, 0);
    worker = std::make_unique<Subprocess>();
    served = StartWorker(*worker, {PATHWAYS_BINARY, "worker", "--controller", address_, "--devices", "4",
                                   "--device-memory", "256MiB", "--data-port", absl::StrCat(data_port),
                                   "--link-port", absl::StrCat(link_port)})
                 .status();
    if (served.ok()) break;
  }
  ASSERT_TRUE(served.ok()) << served;
  Subprocess& fixed = *worker;
  // Another worker asking for either port exits at once, naming it.
  ExpectFailedSaying(RunToEnd(absl::StrCat("worker --controller ", address_, " --link-port ", link_port)),
              absl::StrCat("cannot listen for other hosts on port ", link_port));
  ExpectFailedSaying(RunToEnd(absl::StrCat("worker --controller ", address_, " --data-port ", data_port)),
              absl::StrCat("cannot serve its data stream on port ", data_port));
  ExpectFailedSaying(RunToEnd(absl::StrCat("worker --controller ", address_, " --data-port 70000")),
              "--data-port must be in 0..65535");
  ExpectFailedSaying(RunToEnd(absl::StrCat("worker --controller ", address_, " --hosts 2 --link-port 7100")),
              "the hosts cannot share a port");
  // The worker with fixed ports serves: puts and fetches through its data stream, and an
  // all_reduce with the other two workers over its links.
  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {12}});
  ASSERT_EQ(slice.host_addresses().size(), 3u);
  const TensorSpec row{DType::kF32, {12}};
  auto sum = *client_->Compile(FunctionSpec::Builtin("all_reduce_sum", {row}, {row}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client_->Put(Pattern({12}, 1.0f), slice, {"x"});
  auto out = client_->Fetch((*client_->Call(sum, slice, {x}))[0]).AwaitFor(absl::Seconds(30));
  ASSERT_TRUE(out.ok()) << out.status();
  float want = 0;
  for (int i = 0; i < 12; ++i) want += Pattern({12}, 1.0f).data<float>()[i];
  EXPECT_EQ(out->data<float>()[0], want);
  EXPECT_EQ(fixed.Stop(SIGTERM) & 0x7f, 0);
}

// Tenants show the token, hosts the cluster token: a process with only the tenants' token runs
// jobs, but is refused every call that only hosts and the controller make.
TEST_F(MultiProcessTest, ATenantsTokenDoesNotOpenTheCallsOfHosts) {
  Subprocess controller, worker;
  ASSERT_TRUE(controller
                  .Start({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0", "--token", "tenants",
                          "--cluster-token", "hosts"})
                  .ok());
  auto line = controller.WaitForLine("listening on", kStartTimeout);
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string address = line->substr(line->rfind(' ') + 1);
  ASSERT_TRUE(worker
                  .Start({PATHWAYS_BINARY, "worker", "--controller", address, "--devices", "2", "--token", "tenants",
                          "--cluster-token", "hosts"})
                  .ok());
  auto ready = worker.WaitForLine("serving", kStartTimeout);
  ASSERT_TRUE(ready.ok()) << ready.status();
  const std::string worker_address = ready->substr(7, ready->find(' ', 7) - 7);

  // A worker with only the tenants' token is refused at once, with a reason.
  auto impostor = RunToEnd(absl::StrCat("worker --controller ", address, " --devices 2 --token tenants"));
  EXPECT_TRUE(WIFEXITED(impostor.first) && WEXITSTATUS(impostor.first) != 0) << impostor.second;
  EXPECT_NE(impostor.second.find("refused to register"), std::string::npos) << impostor.second;

  SetCallToken("tenants");
  {
    auto client = Client::Connect(address);
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_NO_FATAL_FAILURE(ExpectAJobOnTwoDevicesRuns(**client));

    ControllerClient as_host(address);
    rpc::RegisterWorkerRequest reg;
    reg.set_address("127.0.0.1:1");
    reg.add_devices();
    EXPECT_EQ(as_host.RegisterWorker(reg).status().code(), absl::StatusCode::kUnauthenticated);
    rpc::HeartbeatRequest beat;
    EXPECT_EQ(as_host.Heartbeat(beat).status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(as_host.RendezvousSet("collective-links/" + worker_address, "127.0.0.1:1").code(),
              absl::StatusCode::kUnauthenticated);
    rpc::ControlGraph graph;
    auto joined = WorkerClientCache::Global().Get(worker_address)->JoinControlGraph(graph).AwaitFor(absl::Seconds(30));
    EXPECT_EQ(joined.status().code(), absl::StatusCode::kUnauthenticated) << joined.status();

    // The plain TCP streams hold the same line: the tenants' token finds the controller's stream
    // listener and opens a schedule stream there, but no dataflow stream, to it or to a worker.
    auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    grpc::ClientContext context;
    AttachCallToken(context);
    rpc::StreamPortResponse port;
    ASSERT_TRUE(rpc::Dataflow::NewStub(channel)->StreamPort(&context, rpc::StreamPortRequest(), &port).ok());
    ASSERT_GT(port.port(), 0);
    EXPECT_TRUE(ScheduleStream::Connect(address, "127.0.0.1", port.port(), absl::Seconds(5)).ok());
    grpc::ClientContext ping_context;
    AttachCallToken(ping_context);
    rpc::PingResponse pong;
    ASSERT_TRUE(rpc::Worker::NewStub(grpc::CreateChannel(worker_address, grpc::InsecureChannelCredentials()))
                    ->Ping(&ping_context, rpc::PingRequest(), &pong)
                    .ok());
    const int worker_data_port = pong.data_port();
    ASSERT_GT(worker_data_port, 0);
    for (int stream_port : {port.port(), worker_data_port}) {
      auto fd = DialStream("test", "127.0.0.1", stream_port, dataflow::kDataflowStreamMagic, "tenants", absl::Seconds(5));
      ASSERT_TRUE(fd.ok()) << fd.status();
      auto refused = ReadStreamHeader(*fd, absl::Seconds(5), "test");
      ASSERT_TRUE(refused.ok()) << refused.status();
      EXPECT_EQ(HeaderStatus(*refused).code(), absl::StatusCode::kUnauthenticated) << refused->message();
      close(*fd);
    }

    // The cluster still serves the tenant.
    ASSERT_NO_FATAL_FAILURE(ExpectAJobOnTwoDevicesRuns(**client));
  }
  SetCallToken("");  // the fixture's cluster needs none
  EXPECT_EQ(worker.Stop(SIGTERM) & 0x7f, 0);
  EXPECT_EQ(controller.Stop(SIGTERM) & 0x7f, 0);
}


// A worker takes messages as large as its protocol needs (one shard of its device memory, one
// dataflow batch), not more: a larger one is refused before it is read into memory, and the
// worker serves on.
TEST_F(MultiProcessTest, AMessageLargerThanAnyShardIsRefusedAndTheWorkerServesOn) {
  auto stub = rpc::Worker::NewStub(grpc::CreateChannel(worker_addresses_[0], grpc::InsecureChannelCredentials()));
  rpc::EnqueueRequest request;
  request.set_client_id("whoever");
  rpc::Op* op = request.add_ops();
  op->set_seq(1);
  op->mutable_put()->set_data(std::string((size_t{258} << 20), 'x'));  // the devices hold 256 MiB
  grpc::ClientContext context;
  rpc::EnqueueResponse response;
  grpc::Status sent = stub->Enqueue(&context, request, &response);
  EXPECT_EQ(sent.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << sent.error_message();
  request.Clear();
  ASSERT_NO_FATAL_FAILURE(ExpectAJobOnTwoDevicesRuns(*client_));
}


// Strangers on every port of a cluster of real processes: the controller's gRPC and stream ports,
// and each worker's gRPC, data stream and collective link ports get random bytes, a huge length
// prefix, an abrupt reset, and a connection that stays silent throughout. Nothing crashes, and a
// job whose collective spans both workers (links), with puts and fetches (data streams), passes.
TEST_F(MultiProcessTest, GarbageOnEveryPortLeavesTheClusterServing) {
  auto port_of = [](const std::string& address) { return std::stoi(address.substr(address.rfind(':') + 1)); };
  std::vector<int> ports = {port_of(address_)};
  {
    grpc::ClientContext context;
    rpc::StreamPortResponse stream;
    ASSERT_TRUE(rpc::Dataflow::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()))
                    ->StreamPort(&context, rpc::StreamPortRequest(), &stream)
                    .ok());
    ports.push_back(stream.port());
  }
  ControllerClient controller(address_);
  for (const std::string& worker : worker_addresses_) {
    ports.push_back(port_of(worker));
    grpc::ClientContext context;
    rpc::PingResponse pong;
    ASSERT_TRUE(rpc::Worker::NewStub(grpc::CreateChannel(worker, grpc::InsecureChannelCredentials()))
                    ->Ping(&context, rpc::PingRequest(), &pong)
                    .ok());
    ports.push_back(pong.data_port());
    auto links = controller.RendezvousGet("collective-links/" + worker, absl::Seconds(10));
    ASSERT_TRUE(links.ok()) << links.status();
    ports.push_back(port_of(*links));
  }
  ASSERT_EQ(ports.size(), 8u);

  std::string noise(64 << 10, '\0');
  uint32_t state = 12345;
  for (char& c : noise) c = static_cast<char>((state = state * 1103515245 + 12345) >> 16);
  const std::string huge_length("\xff\xff\xff\xff\xff\xff\xff\x7f", 8);
  std::vector<int> silent;
  for (int port : ports) {
    ASSERT_GT(port, 0);
    for (const std::string& bytes : {noise, huge_length}) {
      const int fd = testing::DialLoopback(port);
      ASSERT_GE(fd, 0) << port;
      (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      close(fd);
    }
    const int reset = testing::DialLoopback(port);
    ASSERT_GE(reset, 0) << port;
    const linger abrupt{1, 0};
    setsockopt(reset, SOL_SOCKET, SO_LINGER, &abrupt, sizeof(abrupt));
    close(reset);  // RST, not FIN
    silent.push_back(testing::DialLoopback(port));
  }

  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {8}});
  ASSERT_EQ(slice.host_addresses().size(), 2u);
  const TensorSpec row{DType::kF32, {8}};
  auto total = client_->Compile(FunctionSpec::Builtin("all_reduce_sum", {row}, {row}, {{"x"}}, {{"x"}}));
  ASSERT_TRUE(total.ok()) << total.status();
  HostArray data = Pattern({8}, 1.0f);
  float want = 0;
  for (int i = 0; i < 8; ++i) want += data.data<float>()[i];
  for (int round = 0; round < 3; ++round) {
    ShardedArray x = *client_->Put(data, slice, {"x"});
    auto out = client_->Call(*total, slice, {x});
    ASSERT_TRUE(out.ok()) << out.status();
    auto got = client_->Fetch((*out)[0]).AwaitFor(absl::Seconds(60));
    ASSERT_TRUE(got.ok()) << got.status();
    for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(got->data<float>()[i], want);
  }
  for (int fd : silent) {
    if (fd >= 0) close(fd);
  }
}

}  // namespace
}  // namespace pathways
